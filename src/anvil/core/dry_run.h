// The dry run: the real program without data. While a DryRun lives, the
// tracking allocator in use is a fresh dry one (core/allocator.h): every
// tensor is allocated, tagged and freed exactly as in a real run, but no
// memory is committed. Every op allocates its outputs and scratch as it
// always does and then skips its arithmetic (`if (dry_run()) return;` right
// after its allocations); a communicator made for the dry run completes at
// once (distributed/comm.h). So a rank's whole training step — model, FSDP,
// tensor and pipeline parallelism, checkpoint — runs in one process in a
// fraction of its real time, and the dry allocator's record of it is the
// rank's memory, byte for byte: that is the estimator (train/estimate.h).
//
// Values computed in a dry run are meaningless; code that branches on one
// (the loss being finite, the gradient norm) is named where it does so.
#pragma once
#include <atomic>
#include <functional>
#include <memory>

#include "anvil/core/allocator.h"

namespace anvil {

namespace detail {
extern std::atomic<bool> g_dry_run;  // set while a DryRun lives
}  // namespace detail

// True while a DryRun is on (in any thread: the allocator in use is global).
// One relaxed load: parallel_for and every op ask it.
inline bool dry_run() { return detail::g_dry_run.load(std::memory_order_relaxed); }

class DevicePool;

class DryRun {
 public:
  // Installs a fresh dry allocator. One dry run at a time, from one thread,
  // while no other thread allocates (the estimator runs before training or
  // beside nothing). With gpu_memory > 0 it also installs, as cuda:0's pool, a
  // fresh device pool over a fake device memory of that many bytes: a GPU
  // job's tensors are allocated, in the same order, with no GPU present.
  explicit DryRun(size_t gpu_memory = 0);
  // Releases what ops keep between calls for this run (release_at_end) and
  // restores the process's allocator.
  ~DryRun();
  DryRun(const DryRun&) = delete;
  DryRun& operator=(const DryRun&) = delete;

  TrackingAllocator& allocator() { return *allocator_; }
  // The fake GPU's pool (null without one).
  DevicePool* gpu_pool() { return gpu_pool_.get(); }

  // Code that keeps tensors between calls in statics (an op's per-thread
  // buffers) registers how to drop the dry run's, which must go before its
  // allocator does.
  static void release_at_end(std::function<void()> release);

 private:
  std::unique_ptr<TrackingAllocator> allocator_;
  TrackingAllocator* previous_;
  std::unique_ptr<DevicePool> gpu_pool_;
};

}  // namespace anvil
