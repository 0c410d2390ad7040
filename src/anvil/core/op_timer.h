// Per-op time: where a training step's time goes, op by op ([profiling]
// op_times). Every op (a matrix product, attention, a norm, the optimizer's
// pass, a cast) opens a ScopedOpTime; while timing is on, its wall time and
// useful FLOPs are summed per (phase, op), so one table sums to the step.
//
// An op called inside another (a product inside the fused loss) is kept as
// its own row under the outer op, whose "self" time excludes it; calls made
// from inside an OpenMP parallel region (attention's per-tile products on
// every thread) are not timed at all: they belong to the op that opened the
// region, and timing them per thread would count the same seconds twice.
//
// On a GPU the host returns from a launch long before the kernel ends, so
// with a DeviceClock set the ops are timed by stamps on the device's stream
// (CUDA events) instead, read when timing is turned off at the step's end.
//
// Off, a ScopedOpTime costs one relaxed atomic load.
#pragma once
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

namespace anvil {

struct OpTimeRow {
  std::string phase;   // the profiler's phase label, layer index dropped ("attention.forward"); "" outside any
  std::string parent;  // the op this one ran inside, or ""
  std::string op;      // "linear.forward", "attention.backward", ...
  int64_t calls = 0;
  double self_seconds = 0;  // wall time, minus the time of the ops called inside it
  double flops = 0;         // useful FLOPs (what the model's FLOP count credits)
};

// Stamps recorded on a device's stream in its order, read back once the work
// before them is done (the CUDA backend's are events).
class DeviceClock {
 public:
  virtual ~DeviceClock() = default;
  virtual uint32_t stamp() = 0;  // a stamp taken when the stream reaches this point
  // Seconds from stamp `from` to stamp `to`; waits until the stream passes `to`.
  virtual double seconds_between(uint32_t from, uint32_t to) = 0;
  virtual void clear() = 0;  // every stamp read: they may be reused
};

class OpTimer {
 public:
  // Starts (or pauses) timing of the ops the calling thread runs (the
  // trainer's main thread: another thread's ops, a data loader's copies,
  // would overlap the step's time); what was summed stays until reset().
  // Turning it off reads the device clock's stamps taken since it was on.
  static void set_enabled(bool on);
  // Times ops by `clock`'s stamps rather than the host's (null: the host's):
  // the trainer on a GPU sets its runtime's.
  static void set_device_clock(DeviceClock* clock);
  static bool enabled() { return enabled_.load(std::memory_order_relaxed); }
  static void reset();
  // Every (phase, parent, op) seen since the last reset, the longest first.
  static std::vector<OpTimeRow> rows();

 private:
  static std::atomic<bool> enabled_;
};

// Times the enclosing scope as op `name` (a string literal) doing `flops` of useful work.
class ScopedOpTime {
 public:
  explicit ScopedOpTime(const char* name, double flops = 0);
  ~ScopedOpTime();
  ScopedOpTime(const ScopedOpTime&) = delete;
  ScopedOpTime& operator=(const ScopedOpTime&) = delete;

 private:
  const char* name_;
  double flops_;
  double begin_us_ = -1;  // < 0: not timed
  double children_us_ = 0;
  ScopedOpTime* parent_ = nullptr;
  int64_t stamped_ = -1;  // timed by the device clock: this scope's index among its pending records
};

}  // namespace anvil
