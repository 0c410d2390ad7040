// Chrome trace-event JSON (opened by Perfetto and chrome://tracing) for one
// profiled step: a track per thread with the profiler's nested spans, and a
// "memory" counter track with the live bytes of every category after each
// allocation and free.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "anvil/core/allocator.h"
#include "anvil/core/profiler.h"

namespace anvil {

struct StepTrace {
  int64_t step = 0;
  int rank = 0;
  double start_us = 0;  // steady clock; trace times are relative to it
  // This host's steady clock minus rank 0's, and the bound on that
  // (distributed/clock_sync.h), so every host's trace lies on one timeline.
  double clock_offset_us = 0, clock_offset_uncertainty_us = 0;
  std::vector<std::string> thread_names;
  std::vector<SpanRecord> spans;
  std::array<size_t, kNumMemCategories> live_at_start{};
  std::vector<MemEvent> memory_events;
};

// Written atomically (tmp + rename); throws anvil::Error naming the path.
void write_chrome_trace(const StepTrace& t, const std::string& path);

}  // namespace anvil
