#include "anvil/obs/trace.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "anvil/core/durable_file.h"
#include "anvil/core/error.h"

namespace anvil {

namespace {

nlohmann::ordered_json memory_counter(double ts, const std::array<size_t, kNumMemCategories>& live, int rank) {
  nlohmann::ordered_json args;
  for (int c = 0; c < kNumMemCategories; ++c) args[category_name(static_cast<MemCategory>(c))] = live[c];
  return {{"ph", "C"}, {"name", "memory"}, {"ts", ts}, {"pid", rank}, {"args", args}};
}

}  // namespace

void write_chrome_trace(const StepTrace& t, const std::string& path) {
  using nlohmann::ordered_json;
  ordered_json events = ordered_json::array();
  events.push_back({{"ph", "M"}, {"name", "process_name"}, {"pid", t.rank},
                    {"args", {{"name", "anvil rank " + std::to_string(t.rank)}}}});
  for (size_t i = 0; i < t.thread_names.size(); ++i)
    events.push_back({{"ph", "M"}, {"name", "thread_name"}, {"pid", t.rank}, {"tid", i},
                      {"args", {{"name", t.thread_names[i]}}}});
  // Spans sorted by start, the outer one first when two start together, so
  // viewers nest them correctly.
  std::vector<SpanRecord> spans = t.spans;
  std::sort(spans.begin(), spans.end(), [](const SpanRecord& a, const SpanRecord& b) {
    return a.begin_us != b.begin_us ? a.begin_us < b.begin_us : a.end_us > b.end_us;
  });
  for (const SpanRecord& s : spans) {
    ordered_json e = {{"ph", "X"}, {"name", phase_name(s.phase)}, {"cat", span_category_name(s.category)},
                      {"ts", s.begin_us - t.start_us}, {"dur", s.end_us - s.begin_us}, {"pid", t.rank},
                      {"tid", s.thread}};
    if (s.bytes > 0) {
      const double secs = (s.end_us - s.begin_us) * 1e-6;
      e["args"] = {{"bytes", s.bytes}, {"GB/s", secs > 0 ? static_cast<double>(s.bytes) / secs / 1e9 : 0.0}};
    }
    events.push_back(std::move(e));
  }
  std::array<size_t, kNumMemCategories> live = t.live_at_start;
  events.push_back(memory_counter(0, live, t.rank));
  for (const MemEvent& e : t.memory_events) {
    size_t& c = live[static_cast<int>(e.category)];
    c = e.is_alloc ? c + e.bytes : c - e.bytes;
    events.push_back(memory_counter(e.time_us - t.start_us, live, t.rank));
  }
  ordered_json doc;
  doc["traceEvents"] = std::move(events);
  doc["displayTimeUnit"] = "ms";
  // clock_origin_us: rank 0's steady clock at ts 0, so every rank's trace, on
  // any host, lies on one timeline (to within the offset's uncertainty).
  doc["otherData"] = {{"step", t.step},
                      {"rank", t.rank},
                      {"producer", "anvil"},
                      {"clock_origin_us", t.start_us - t.clock_offset_us},
                      {"clock_offset_us", t.clock_offset_us},
                      {"clock_offset_uncertainty_us", t.clock_offset_uncertainty_us}};

  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  ANVIL_CHECK(!ec, "cannot create the folder of '", path, "': ", ec.message());
  write_file_durably(path, doc.dump() + "\n");
}

}  // namespace anvil
