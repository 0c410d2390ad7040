// The trainer's profiling: a Chrome trace and a memory snapshot of chosen
// steps ([profiling]), and the list of live tensors when memory runs out.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "anvil/core/allocator.h"
#include "anvil/core/device.h"
#include "anvil/core/error.h"
#include "anvil/obs/trace.h"
#include "anvil/train/config.h"
#include "anvil/train/parallel_dims.h"

namespace anvil {

// Captures one step: the profiler's spans and the allocator's timeline, then
// writes the Chrome trace and, if asked, the memory snapshot at the step's peak.
class StepCapture {
 public:
  StepCapture(int64_t step, const std::string& trace_path, const std::string& snapshot_path, int rank = 0);
  // A step that ends early (skipped, interrupted) writes nothing.
  ~StepCapture();
  StepCapture(const StepCapture&) = delete;
  StepCapture& operator=(const StepCapture&) = delete;
  // Writes the files; returns what was written, for the console.
  std::string finish();

 private:
  int64_t step_;
  std::string trace_path_, snapshot_path_;
  StepTrace trace_;
  std::vector<LiveAllocation> live_before_;
  bool finished_ = false;
};

// Where the files go: <dump_folder>/<save_traces_folder> and <save_memory_snapshot_folder>.
std::string trace_dir(const JobConfig& cfg);
std::string snapshot_dir(const JobConfig& cfg);

// The capture of `step` when the configuration profiles it (the first step and
// every profile_freq-th), else null: on rank 0 only, except that under
// pipeline parallelism every rank writes its trace (step-N.rank-R.trace.json
// beside rank 0's step-N.trace.json), since a pipeline's bubbles are seen only
// across ranks (bench/pipeline_bubbles.py lays them on one timeline).
std::unique_ptr<StepCapture> capture_if_profiled(const JobConfig& cfg, const ParallelDims& par, int64_t step,
                                                 int64_t first_step);

// Finishes a step's capture, if any, and says on the console what it wrote.
void finish_capture(std::unique_ptr<StepCapture>& capture, int64_t step);

size_t begin_allocation_log();
void end_allocation_log(const JobConfig& cfg, const ParallelDims& par, size_t from);
// With profiling.allocation_log_step set, the run's peaks (StepLogger::run_peaks)
// to <dump_folder>/allocations/rank-<r>.peaks.json, in bytes, at its end.
// A job on a GPU (device not the host) adds its device pool's, `device_peaks`.
void write_run_peaks(const JobConfig& cfg, const ParallelDims& par, const MemStats& peaks, Device device = Device::cpu(),
                     const MemStats& device_peaks = {});
// Runs `step_fn` (the step's run_train_step); when `step` is
// profiling.allocation_log_step, writes every allocation and free it made to
// <dump_folder>/allocations/rank-<r>.jsonl (obs/allocation_log.h).
template <class F>
auto log_allocations_of(const JobConfig& cfg, const ParallelDims& par, int64_t step, F&& step_fn) {
  if (step != cfg.profiling.allocation_log_step) return step_fn();
  const size_t from = begin_allocation_log();
  auto result = step_fn();
  end_allocation_log(cfg, par, from);
  return result;
}
// Writes what was live when memory ran out in `step` to the snapshot folder,
// for the user to see where it went, and throws `e` again saying where that
// list is and what would fit.
[[noreturn]] void rethrow_with_oom_snapshot(const OutOfMemoryError& e, const JobConfig& cfg, const ParallelDims& par,
                                            int64_t step);

}  // namespace anvil
