#include "anvil/train/profiling.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "anvil/core/durable_file.h"
#include "anvil/core/profiler.h"
#include "anvil/distributed/clock_sync.h"
#include "anvil/obs/allocation_log.h"
#include "anvil/obs/memory_snapshot.h"

namespace anvil {

StepCapture::StepCapture(int64_t step, const std::string& trace_path, const std::string& snapshot_path, int rank)
    : step_(step), trace_path_(trace_path), snapshot_path_(snapshot_path) {
  trace_.rank = rank;
  auto& alloc = TrackingAllocator::instance();
  trace_.step = step;
  trace_.live_at_start = alloc.stats().live;
  if (!snapshot_path_.empty()) live_before_ = alloc.live_allocations();
  alloc.clear_timeline();
  alloc.set_timeline(true);
  trace_.start_us = steady_now_us();
  trace_.clock_offset_us = clock_offset_us();
  trace_.clock_offset_uncertainty_us = clock_offset_uncertainty_us();
  Profiler::instance().start();
}

StepCapture::~StepCapture() {
  if (finished_) return;
  Profiler::instance().stop();
  TrackingAllocator::instance().set_timeline(false);
  TrackingAllocator::instance().clear_timeline();
}

std::string StepCapture::finish() {
  finished_ = true;
  auto& alloc = TrackingAllocator::instance();
  Profiler::instance().stop();
  alloc.set_timeline(false);
  trace_.memory_events = alloc.timeline();
  alloc.clear_timeline();
  trace_.spans = Profiler::instance().spans();
  trace_.thread_names = Profiler::instance().thread_names();
  std::string written;
  if (!trace_path_.empty()) {
    write_chrome_trace(trace_, trace_path_);
    written = "trace " + trace_path_;
  }
  if (!snapshot_path_.empty()) {
    MemorySnapshot snap = snapshot_at_peak(live_before_, trace_.memory_events, 25);
    snap.step = step_;
    snap.reason = "peak";
    add_device_pool(snap);
    write_memory_snapshot(snap, snapshot_path_);
    written += (written.empty() ? "" : ", ") +
               ("memory snapshot " + snapshot_path_ + " (peak " + human_bytes(snap.total_bytes) + ")");
  }
  return written;
}

std::string trace_dir(const JobConfig& cfg) {
  return (std::filesystem::path(cfg.job.dump_folder) / cfg.profiling.save_traces_folder).string();
}

std::string snapshot_dir(const JobConfig& cfg) {
  return (std::filesystem::path(cfg.job.dump_folder) / cfg.profiling.save_memory_snapshot_folder).string();
}

namespace {
bool g_log_turned_timeline_on = false;  // the allocation log, not a step capture, switched the timeline on
}  // namespace

void write_run_peaks(const JobConfig& cfg, const ParallelDims& par, const MemStats& peaks, Device device,
                     const MemStats& device_peaks) {
  if (cfg.profiling.allocation_log_step <= 0) return;
  nlohmann::json j;
  for (int c = 0; c < kNumMemCategories; ++c) j["peak_bytes"][category_name(static_cast<MemCategory>(c))] = peaks.peak[c];
  j["peak_total_bytes"] = peaks.peak_total;
  j["peak_reserved_bytes"] = peaks.peak_reserved;
  if (!device.is_cpu()) {
    nlohmann::json& d = j["device"];
    d["name"] = device.str();
    for (int c = 0; c < kNumMemCategories; ++c)
      d["peak_bytes"][category_name(static_cast<MemCategory>(c))] = device_peaks.peak[c];
    d["peak_total_bytes"] = device_peaks.peak_total;
    d["peak_reserved_bytes"] = device_peaks.peak_reserved;
  }
  const std::filesystem::path dir = std::filesystem::path(cfg.job.dump_folder) / "allocations";
  std::filesystem::create_directories(dir);
  write_file_durably(dir / detail::concat("rank-", par.rank, ".peaks.json"), j.dump(2) + "\n");
}

size_t begin_allocation_log() {
  TrackingAllocator& alloc = TrackingAllocator::instance();
  g_log_turned_timeline_on = !alloc.timeline_on();
  alloc.set_timeline(true);
  return alloc.timeline().size();
}

void end_allocation_log(const JobConfig& cfg, const ParallelDims& par, size_t from) {
  TrackingAllocator& alloc = TrackingAllocator::instance();
  std::vector<MemEvent> events = alloc.timeline();
  if (g_log_turned_timeline_on) {
    alloc.set_timeline(false);
    alloc.clear_timeline();
  }
  events.erase(events.begin(), events.begin() + static_cast<std::ptrdiff_t>(std::min(from, events.size())));
  const std::string path = (std::filesystem::path(cfg.job.dump_folder) / "allocations" /
                            detail::concat("rank-", par.rank, ".jsonl"))
                               .string();
  write_allocation_log(path, events);
  if (par.rank0())
    std::printf("anvil: step %lld's %zu allocations and frees written to %s (rank 0's; every rank writes its own)\n",
                static_cast<long long>(cfg.profiling.allocation_log_step), events.size(), path.c_str());
}

std::unique_ptr<StepCapture> capture_if_profiled(const JobConfig& cfg, const ParallelDims& par, int64_t step,
                                                 int64_t first_step) {
  const auto& p = cfg.profiling;
  // Pipeline stages and context-parallel ranks each do their own part of the
  // work, so every rank traces (their bubbles, their attention's balance).
  const bool every_rank_traces = (par.pp_size > 1 || par.cp_size > 1) && p.enable_profiling;
  const bool profile_step = (par.rank0() || every_rank_traces) && (p.enable_profiling || p.enable_memory_snapshot) &&
                            (step == first_step || step % p.profile_freq == 0);
  if (!profile_step) return nullptr;
  const std::string name = "step-" + std::to_string(step);
  const std::string trace_name = name + (par.rank0() ? "" : ".rank-" + std::to_string(par.rank)) + ".trace.json";
  return std::make_unique<StepCapture>(
      step, p.enable_profiling ? (std::filesystem::path(trace_dir(cfg)) / trace_name).string() : "",
      p.enable_memory_snapshot && par.rank0()
          ? (std::filesystem::path(snapshot_dir(cfg)) / (name + ".snapshot.json")).string()
          : "",
      par.rank);
}

void finish_capture(std::unique_ptr<StepCapture>& capture, int64_t step) {
  if (!capture) return;
  const std::string written = capture->finish();
  if (!written.empty()) std::printf("anvil: step %lld: %s\n", static_cast<long long>(step), written.c_str());
}

void rethrow_with_oom_snapshot(const OutOfMemoryError& e, const JobConfig& cfg, const ParallelDims& par, int64_t step) {
  auto& alloc = TrackingAllocator::instance();
  Profiler::instance().stop();
  alloc.set_timeline(false);
  MemorySnapshot snap = snapshot_now(alloc.live_allocations(), 25);
  snap.step = step;
  snap.reason = "out_of_memory";
  add_device_pool(snap);
  const std::string name = "step-" + std::to_string(step) +
                           (par.distributed() ? ".rank-" + std::to_string(par.rank) : std::string()) +
                           ".oom.snapshot.json";
  const std::string path = (std::filesystem::path(snapshot_dir(cfg)) / name).string();
  write_memory_snapshot(snap, path);
  throw OutOfMemoryError(detail::concat(e.what(), "; the ", snap.num_live, " live tensors are listed in ", path,
                                        ". Lower training.local_batch_size or training.seq_len, use "
                                        "activation_checkpoint.mode = \"full\", or pick a smaller model.flavor"));
}

}  // namespace anvil
