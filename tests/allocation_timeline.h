// The estimator's dry run held against a real run, event by event: the real
// run writes each rank's allocations and frees of step 2
// (profiling.allocation_log_step 2, obs/allocation_log.h); the dry run of the
// same rank (train/estimate.h's dry_run_rank, in this process, from the run's
// own flags) must make the same allocations and frees in the same order —
// tag, category and bytes — so a temporary freed before the peak, or a buffer
// whose lifetime moved, shows here even when no peak changes; and the run's
// peaks — every category, the total, the reserved bytes — equal the dry run's
// to the byte (allocations/rank-r.peaks.json).
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "anvil/core/allocator.h"
#include "anvil/obs/allocation_log.h"
#include "anvil/train/config.h"
#include "anvil/train/estimate.h"
#include "test_util.h"

namespace anvil::testing {

inline std::string event_str(const MemEvent& e) {
  return std::string(e.is_alloc ? "alloc " : "free  ") + e.tag + " (" + category_name(e.category) + ", " +
         std::to_string(e.bytes) + " bytes)";
}

// Returns the number of events compared; a difference fails the test with the
// first event where the two part and a few around it, and so does a step with
// no events at all (two empty logs would agree on nothing).
inline size_t expect_same_allocations(const std::vector<MemEvent>& real, const std::vector<MemEvent>& dry,
                                      const std::string& what) {
  if (real.empty()) {
    ADD_FAILURE() << what << ": the real run logged no allocation events for the step (dry run: " << dry.size() << ")";
    return 0;
  }
  const size_t n = std::min(real.size(), dry.size());
  size_t first = n;
  for (size_t i = 0; i < n && first == n; ++i) {
    const MemEvent &a = real[i], &b = dry[i];
    if (a.is_alloc != b.is_alloc || a.tag != b.tag || a.category != b.category || a.bytes != b.bytes) first = i;
  }
  if (first == n && real.size() == dry.size()) return n;
  std::string context;
  const size_t from = first >= 4 ? first - 4 : 0;
  for (size_t i = from; i < std::min(first + 5, std::max(real.size(), dry.size())); ++i)
    context += "\n  " + std::to_string(i) + (i == first ? " >> " : "    ") + "real: " +
               (i < real.size() ? event_str(real[i]) : "(none)") + " | dry: " +
               (i < dry.size() ? event_str(dry[i]) : "(none)");
  ADD_FAILURE() << what << ": the dry run's step 2 parts from the real run's at event " << first << " of "
                << real.size() << " (dry run: " << dry.size() << ")" << context;
  return first;
}

// Rank r's peaks over the whole run in `dump` (its allocations/rank-r.peaks.json)
// against an estimate: every category, the total and the reserved bytes, to the byte.
inline void expect_peaks_equal(const std::filesystem::path& dump, int r, const MemoryEstimate& e) {
  std::ifstream f(dump / "allocations" / ("rank-" + std::to_string(r) + ".peaks.json"));
  ASSERT_TRUE(f.good()) << "rank " << r << ": no peaks file in " << dump;
  const nlohmann::json j = nlohmann::json::parse(f);
  for (int cat = 0; cat < kNumMemCategories; ++cat) {
    const char* name = category_name(static_cast<MemCategory>(cat));
    EXPECT_EQ(j["peak_bytes"][name].get<size_t>(), e.peak[static_cast<size_t>(cat)]) << "rank " << r << " " << name;
  }
  EXPECT_EQ(j["peak_total_bytes"].get<size_t>(), e.peak_total) << "rank " << r << " peak total";
  EXPECT_EQ(j["peak_reserved_bytes"].get<size_t>(), e.peak_reserved) << "rank " << r << " reserved";
}

// Every rank of a run in `dump` (made with `cfg` over `ranks` ranks and
// profiling.allocation_log_step 2, each rank on `threads` threads) against
// its dry run: step 2 event by event, and the run's peaks to the byte.
// Returns the events compared.
inline size_t expect_dry_run_matches_log(const std::filesystem::path& dump, const JobConfig& cfg, int ranks,
                                         int threads) {
  const ScopedThreads scoped(threads);
  const ModelArgs args = job_model_args(cfg);
  size_t events = 0;
  for (int r = 0; r < ranks; ++r) {
    const std::filesystem::path log = dump / "allocations" / ("rank-" + std::to_string(r) + ".jsonl");
    if (!std::filesystem::exists(log)) {
      ADD_FAILURE() << "no allocation log " << log;
      continue;
    }
    std::vector<MemEvent> dry;
    const RankEstimate est = dry_run_rank(cfg, args, ranks, r, &dry);
    events += expect_same_allocations(read_allocation_log(log.string()), dry, "rank " + std::to_string(r));
    expect_peaks_equal(dump, r, est.memory);
  }
  return events;
}

}  // namespace anvil::testing
