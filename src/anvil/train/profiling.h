// The trainer's profiling: a Chrome trace and a memory snapshot of chosen
// steps ([profiling]), and the list of live tensors when memory runs out.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "anvil/core/allocator.h"
#include "anvil/core/error.h"
#include "anvil/obs/trace.h"
#include "anvil/train/config.h"
#include "anvil/train/parallel.h"

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
std::unique_ptr<StepCapture> capture_if_profiled(const JobConfig& cfg, const Parallel& par, int64_t step,
                                                 int64_t first_step);

// Finishes a step's capture, if any, and says on the console what it wrote.
void finish_capture(std::unique_ptr<StepCapture>& capture, int64_t step);

// Writes what was live when memory ran out in `step` to the snapshot folder,
// for the user to see where it went, and throws `e` again saying where that
// list is and what would fit.
[[noreturn]] void rethrow_with_oom_snapshot(const OutOfMemoryError& e, const JobConfig& cfg, const Parallel& par,
                                            int64_t step);

}  // namespace anvil
