#include "anvil/obs/memory_snapshot.h"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "anvil/core/device.h"
#include "anvil/core/device_pool.h"
#include "anvil/core/durable_file.h"
#include "anvil/core/error.h"

namespace anvil {

namespace {

MemorySnapshot summarise(const std::vector<LiveAllocation>& live, size_t top_k) {
  MemorySnapshot s;
  s.num_live = live.size();
  for (const LiveAllocation& a : live) {
    s.total_bytes += a.bytes;
    s.by_category[static_cast<int>(a.category)] += a.bytes;
  }
  std::vector<const LiveAllocation*> order;
  for (const LiveAllocation& a : live) order.push_back(&a);
  std::sort(order.begin(), order.end(), [](const LiveAllocation* x, const LiveAllocation* y) {
    return x->bytes != y->bytes ? x->bytes > y->bytes : x->tag < y->tag;
  });
  for (size_t i = 0; i < std::min(top_k, order.size()); ++i) {
    const std::string phase = phase_name(order[i]->phase);
    s.largest.push_back({order[i]->tag, order[i]->category, order[i]->bytes, phase.empty() ? "(none)" : phase});
  }
  return s;
}

}  // namespace

MemorySnapshot snapshot_now(const std::vector<LiveAllocation>& live, size_t top_k) {
  MemorySnapshot s = summarise(live, top_k);
  s.time_us = steady_now_us();
  return s;
}

MemorySnapshot snapshot_at_peak(const std::vector<LiveAllocation>& live_before, const std::vector<MemEvent>& events,
                                size_t top_k) {
  // First pass: where the live total is highest (the first time it gets there).
  size_t total = 0;
  for (const LiveAllocation& a : live_before) total += a.bytes;
  size_t peak = total, peak_events = 0;  // the peak holds after the first peak_events events
  for (size_t i = 0; i < events.size(); ++i) {
    total = events[i].is_alloc ? total + events[i].bytes : total - events[i].bytes;
    if (total > peak) peak = total, peak_events = i + 1;
  }
  // Second pass: replay up to that point.
  std::unordered_map<const void*, LiveAllocation> live;
  for (const LiveAllocation& a : live_before) live.emplace(a.ptr, a);
  for (size_t i = 0; i < peak_events; ++i) {
    const MemEvent& e = events[i];
    if (e.is_alloc)
      live[e.ptr] = LiveAllocation{e.bytes, e.category, e.tag, e.phase, e.ptr};
    else
      live.erase(e.ptr);
  }
  std::vector<LiveAllocation> at_peak;
  for (auto& [p, a] : live) at_peak.push_back(a);
  MemorySnapshot s = summarise(at_peak, top_k);
  s.time_us = peak_events > 0 ? events[peak_events - 1].time_us : (events.empty() ? 0 : events.front().time_us);
  ANVIL_ASSERT(s.total_bytes == peak, "snapshot replay ", s.total_bytes, " != peak ", peak);
  return s;
}

void add_device_pool(MemorySnapshot& s) {
  const Device d = default_device();
  if (d.is_cpu()) return;
  s.device = d.str();
  s.device_stats = mem_stats(device_pool(d).stats());
}

void write_memory_snapshot(const MemorySnapshot& s, const std::string& path) {
  nlohmann::ordered_json j;
  j["step"] = s.step;
  j["reason"] = s.reason;
  j["peak_bytes"] = s.total_bytes;
  nlohmann::ordered_json cats;
  for (int c = 0; c < kNumMemCategories; ++c) cats[category_name(static_cast<MemCategory>(c))] = s.by_category[c];
  j["by_category"] = cats;
  j["num_live_tensors"] = s.num_live;
  if (!s.device.empty()) {
    nlohmann::ordered_json d;
    d["name"] = s.device;
    d["allocated_bytes"] = s.device_stats.live_total;
    d["max_allocated_bytes"] = s.device_stats.peak_total;
    d["reserved_bytes"] = s.device_stats.reserved;
    d["max_reserved_bytes"] = s.device_stats.peak_reserved;
    d["allocations"] = s.device_stats.num_allocs;
    for (int c = 0; c < kNumMemCategories; ++c) {
      d["live_by_category"][category_name(static_cast<MemCategory>(c))] = s.device_stats.live[c];
      d["peak_by_category"][category_name(static_cast<MemCategory>(c))] = s.device_stats.peak[c];
    }
    j["device_pool"] = d;
  }
  j["largest"] = nlohmann::ordered_json::array();
  for (const SnapshotEntry& e : s.largest)
    j["largest"].push_back(
        {{"name", e.name}, {"category", category_name(e.category)}, {"bytes", e.bytes}, {"phase", e.phase}});
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path(), ec);
  ANVIL_CHECK(!ec, "cannot create the folder of '", path, "': ", ec.message());
  write_file_durably(path, j.dump(1) + "\n");
}

}  // namespace anvil
