#include "anvil/core/allocator.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "anvil/core/error.h"

namespace anvil {

std::string human_bytes(size_t b) {
  char buf[32];
  if (b >= (size_t{1} << 30)) std::snprintf(buf, sizeof buf, "%.2f GiB", static_cast<double>(b) / (1 << 30));
  else if (b >= (size_t{1} << 20)) std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(b) / (1 << 20));
  else std::snprintf(buf, sizeof buf, "%.1f KiB", static_cast<double>(b) / 1024);
  return buf;
}

const char* category_name(MemCategory c) {
  switch (c) {
    case MemCategory::parameters: return "parameters";
    case MemCategory::gradients: return "gradients";
    case MemCategory::optimizer_state: return "optimizer_state";
    case MemCategory::activations: return "activations";
    case MemCategory::communication: return "communication";
    case MemCategory::workspace: return "workspace";
  }
  return "?";
}

TrackingAllocator& TrackingAllocator::instance() {
  static TrackingAllocator a;
  return a;
}

void* TrackingAllocator::allocate(size_t bytes, MemCategory category, std::string_view tag) {
  const size_t rounded = std::max<size_t>(64, (bytes + 63) / 64 * 64);
  void* p = std::aligned_alloc(64, rounded);
  if (p == nullptr) {
    std::lock_guard lock(mutex_);
    throw OutOfMemoryError(detail::concat("out of memory allocating ", human_bytes(bytes), " for '", tag, "' (",
                               category_name(category), ") with ", human_bytes(stats_.live_total),
                               " already live"));
  }
  std::lock_guard lock(mutex_);
  const int c = static_cast<int>(category);
  stats_.live[c] += bytes;
  stats_.live_total += bytes;
  stats_.peak[c] = std::max(stats_.peak[c], stats_.live[c]);
  stats_.peak_total = std::max(stats_.peak_total, stats_.live_total);
  ++stats_.num_allocs;
  const Phase phase = current_phase();
  live_.emplace(p, LiveAllocation{bytes, category, std::string(tag), phase, p});
  if (timeline_on_)
    timeline_.push_back({steady_now_us(), true, category, bytes, std::string(tag), stats_.live_total, p, phase});
  return p;
}

void TrackingAllocator::deallocate(void* ptr) {
  if (ptr == nullptr) return;
  {
    std::lock_guard lock(mutex_);
    auto it = live_.find(ptr);
    ANVIL_ASSERT(it != live_.end(), "freeing a pointer the tracking allocator does not own");
    const LiveAllocation& a = it->second;
    const int c = static_cast<int>(a.category);
    stats_.live[c] -= a.bytes;
    stats_.live_total -= a.bytes;
    if (timeline_on_)
      timeline_.push_back({steady_now_us(), false, a.category, a.bytes, a.tag, stats_.live_total, ptr, a.phase});
    live_.erase(it);
  }
  std::free(ptr);
}

MemStats TrackingAllocator::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}
size_t TrackingAllocator::live_bytes(MemCategory c) const { return stats().live[static_cast<int>(c)]; }
size_t TrackingAllocator::peak_bytes(MemCategory c) const { return stats().peak[static_cast<int>(c)]; }
size_t TrackingAllocator::live_total() const { return stats().live_total; }
size_t TrackingAllocator::peak_total() const { return stats().peak_total; }

void TrackingAllocator::reset_peak() {
  std::lock_guard lock(mutex_);
  stats_.peak = stats_.live;
  stats_.peak_total = stats_.live_total;
}

void TrackingAllocator::set_timeline(bool on) {
  std::lock_guard lock(mutex_);
  timeline_on_ = on;
}
std::vector<MemEvent> TrackingAllocator::timeline() const {
  std::lock_guard lock(mutex_);
  return timeline_;
}
void TrackingAllocator::clear_timeline() {
  std::lock_guard lock(mutex_);
  timeline_.clear();
}

std::vector<LiveAllocation> TrackingAllocator::live_allocations() const {
  std::lock_guard lock(mutex_);
  std::vector<LiveAllocation> all;
  all.reserve(live_.size());
  for (const auto& [p, a] : live_) all.push_back(a);
  return all;
}

std::vector<LiveAllocation> TrackingAllocator::largest_live(size_t count) const {
  std::vector<LiveAllocation> all = live_allocations();
  std::sort(all.begin(), all.end(), [](const auto& a, const auto& b) { return a.bytes > b.bytes; });
  if (all.size() > count) all.resize(count);
  return all;
}

}  // namespace anvil
