// Reads what a training run leaves in its job.dump_folder: metrics.jsonl (one
// JSON object per logged step), Chrome trace-event files of profiled steps
// (step-N.trace.json) and memory snapshots (step-N.snapshot.json). The readers
// are strict about what they understand (a malformed line is an error naming
// file:line) and ignore what they do not (unknown keys and kinds of line), so
// a newer trainer's output still reads.
#pragma once
#include <array>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "anvil/core/allocator.h"

namespace anvil {

// Bytes per memory category, indexed by MemCategory.
using CategoryBytes = std::array<double, kNumMemCategories>;

// One training line of metrics.jsonl. Fields the line lacks (an older
// trainer) or holds as null (a non-finite value; JSON has no NaN) are NaN.
inline constexpr double kMissing = std::numeric_limits<double>::quiet_NaN();
struct TrainMetrics {
  int64_t step = 0;
  double loss = kMissing, grad_norm = kMissing, lr = kMissing, tokens_per_s = kMissing, tflops = kMissing,
         mfu_pct = kMissing, max_active_bytes = kMissing, data_loading_pct = kMissing, elapsed_s = kMissing;
  CategoryBytes max_active_bytes_by_category{kMissing, kMissing, kMissing, kMissing, kMissing, kMissing};
};

struct ValidationMetrics {
  int64_t step = 0;
  double loss = 0;
  int64_t tokens = 0;
};

struct RunMetrics {
  std::string path;
  std::vector<TrainMetrics> train;            // ascending step, one per step
  std::vector<ValidationMetrics> validation;  // ascending step, one per step
  int64_t replaced_lines = 0;                 // lines overridden by a later line for the same step (a resumed run)
};

// Reads <dump_folder>/metrics.jsonl. A run resumed from a checkpoint appends
// the steps after the checkpoint again, so for a repeated step the later line
// wins. Throws anvil::Error when the file is missing, holds no training line,
// or has a line that is not a JSON object or whose known fields have the wrong type.
RunMetrics read_metrics(const std::filesystem::path& dump_folder);

// A complete span ("ph":"X"). Spans nest by time on one thread; depth 0 is
// outermost (the step span, when the trainer writes one).
struct TraceSpan {
  std::string name, category;  // category: step, data, forward, backward, recompute, loss, optimizer, ...
  double start_us = 0, duration_us = 0;
  int64_t thread = 0;
  int depth = 0;
  double end_us() const { return start_us + duration_us; }
};

// Live bytes per category right after one allocation or free.
struct MemorySample {
  double time_us = 0;
  CategoryBytes live{};
  double total() const;
};

struct TraceFileStep {
  std::string path;
  int64_t step = 0;
  std::vector<TraceSpan> spans;      // by start time; depth set
  std::vector<MemorySample> memory;  // by time
  std::map<int64_t, std::string> thread_names;
  int64_t main_thread = 0;  // the thread running the step span
};

struct TraceFile {
  std::string path;
  int64_t step = 0;
};

// Every *.trace.json under the folder (recursively), by step then path. The
// step comes from a step-N.trace.json name, else from the file's otherData.step.
std::vector<TraceFile> find_traces(const std::filesystem::path& dump_folder);
TraceFileStep read_trace(const TraceFile& file);

struct SnapshotTensor {
  std::string name, category, phase;
  double bytes = 0;
};

struct SnapshotFile {
  std::string path;
  int64_t step = 0;
  std::string reason;  // "peak" or "out_of_memory"
  double peak_bytes = 0;
  CategoryBytes by_category{};
  std::vector<SnapshotTensor> largest;  // largest first
};

// Every *.snapshot.json under the folder (recursively), by step then path.
std::vector<SnapshotFile> read_snapshots(const std::filesystem::path& dump_folder);

}  // namespace anvil
