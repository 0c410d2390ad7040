#include "anvil/core/allocator.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <sys/mman.h>

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

namespace {
std::atomic<TrackingAllocator*> g_installed{nullptr};  // a dry run's allocator, or null
}  // namespace

TrackingAllocator& TrackingAllocator::instance() {
  if (TrackingAllocator* a = g_installed.load(std::memory_order_acquire)) return *a;
  static TrackingAllocator process(/*dry=*/false);
  return process;
}

TrackingAllocator* TrackingAllocator::install(TrackingAllocator* a) { return g_installed.exchange(a); }

TrackingAllocator::TrackingAllocator(bool dry) : dry_(dry) {}

TrackingAllocator::~TrackingAllocator() { release_cache(); }

size_t cached_block_bytes(size_t bytes) {
  constexpr size_t kPage = 4096;
  return bytes >= kCachedBlockMin ? (bytes + kPage - 1) / kPage * kPage : 0;
}

void* TrackingAllocator::map_block(size_t block) const {
  if (dry_) {
    // A dry block is an address and nothing more: one from the non-canonical
    // range of x86-64 (bit 62 set), which no mapping can ever occupy, so the
    // dry run takes no address space (a `ulimit -v` would otherwise refuse
    // it) and any access to it faults. Addresses are never reused.
    static std::atomic<uintptr_t> next{uintptr_t{1} << 62};
    return reinterpret_cast<void*>(next.fetch_add(block));
  }
  void* p = mmap(nullptr, block, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  return p == MAP_FAILED ? nullptr : p;
}

void* TrackingAllocator::allocate(size_t bytes, MemCategory category, std::string_view tag) {
  const size_t block = cached_block_bytes(bytes);
  void* p = nullptr;
  bool reused = false;
  if (block > 0) {
    {
      std::lock_guard lock(mutex_);
      requested_since_trim_[block] = true;
      auto it = free_blocks_.find(block);
      if (it != free_blocks_.end() && !it->second.empty()) {
        p = it->second.back();
        it->second.pop_back();
        stats_.cached -= block;
        reused = true;
      }
    }
    if (p == nullptr) p = map_block(block);
    if (p == nullptr) {  // the cache's other sizes may be what is missing
      release_cache();
      p = map_block(block);
    }
  } else {
    p = std::aligned_alloc(64, std::max<size_t>(64, (bytes + 63) / 64 * 64));
  }
  if (p == nullptr) {
    std::lock_guard lock(mutex_);
    throw OutOfMemoryError(detail::concat("out of memory allocating ", human_bytes(bytes), " for '", tag, "' (",
                               category_name(category), ") with ", human_bytes(stats_.live_total),
                               " already live"));
  }
  std::lock_guard lock(mutex_);
  if (!reused) stats_.reserved += block > 0 ? block : bytes;
  stats_.peak_reserved = std::max(stats_.peak_reserved, stats_.reserved);
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
  size_t block = 0;
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
    block = cached_block_bytes(a.bytes);
    if (block > 0 && block <= kCachedBlockMax) {
      free_blocks_[block].push_back(ptr);
      stats_.cached += block;
    } else {
      stats_.reserved -= block > 0 ? block : a.bytes;
    }
    live_.erase(it);
  }
  if (block == 0) std::free(ptr);
  else if (block > kCachedBlockMax && !dry_) munmap(ptr, block);
}

void TrackingAllocator::release_blocks(const std::vector<std::pair<void*, size_t>>& blocks) {
  if (dry_) return;  // its blocks are addresses only
  for (const auto& [p, size] : blocks) munmap(p, size);
}

void TrackingAllocator::trim_cache() {
  std::vector<std::pair<void*, size_t>> released;
  {
    std::lock_guard lock(mutex_);
    for (auto& [size, blocks] : free_blocks_) {
      if (requested_since_trim_.count(size)) continue;
      for (void* p : blocks) released.emplace_back(p, size);
      stats_.cached -= blocks.size() * size;
      stats_.reserved -= blocks.size() * size;
      blocks.clear();
    }
    requested_since_trim_.clear();
  }
  release_blocks(released);
}

void TrackingAllocator::release_cache() {
  std::vector<std::pair<void*, size_t>> released;
  {
    std::lock_guard lock(mutex_);
    for (auto& [size, blocks] : free_blocks_) {
      for (void* p : blocks) released.emplace_back(p, size);
      blocks.clear();
    }
    stats_.reserved -= stats_.cached;
    stats_.cached = 0;
  }
  release_blocks(released);
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
  stats_.peak_reserved = stats_.reserved;
}

void TrackingAllocator::set_timeline(bool on) {
  std::lock_guard lock(mutex_);
  timeline_on_ = on;
}
bool TrackingAllocator::timeline_on() const {
  std::lock_guard lock(mutex_);
  return timeline_on_;
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
