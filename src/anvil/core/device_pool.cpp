#include "anvil/core/device_pool.h"

#include <algorithm>

#include "anvil/core/error.h"

namespace anvil {

MemStats mem_stats(const DevicePoolStats& s) {
  MemStats m;
  m.live = s.live;
  m.peak = s.peak;
  m.live_total = s.allocated;
  m.peak_total = s.peak_allocated;
  m.num_allocs = static_cast<size_t>(s.num_allocs);
  m.reserved = s.reserved;
  m.peak_reserved = s.peak_reserved;
  m.cached = s.reserved - s.allocated;
  return m;
}

namespace {

constexpr size_t kMinBlock = 512;               // every block a multiple of it
constexpr size_t kSmallSize = size_t{1} << 20;  // requests up to this: the small pool
constexpr size_t kSmallSegment = size_t{2} << 20;
constexpr size_t kMinLargeAlloc = size_t{10} << 20;  // large requests below this share a 20 MiB segment
constexpr size_t kLargeSegment = size_t{20} << 20;
constexpr size_t kRoundLarge = size_t{2} << 20;  // larger ones get their own, rounded to 2 MiB

}  // namespace

FakeDeviceMemory::FakeDeviceMemory(size_t capacity) : capacity_(capacity) {}

void* FakeDeviceMemory::map(size_t bytes) {
  if (bytes > capacity_ - mapped_) return nullptr;
  mapped_ += bytes;
  ++maps_;
  void* p = reinterpret_cast<void*>(next_);
  next_ += (bytes + kRoundLarge - 1) / kRoundLarge * kRoundLarge;
  return p;
}

void FakeDeviceMemory::unmap(void*, size_t bytes) { mapped_ -= bytes; }

std::string FakeDeviceMemory::name() const { return "fake device (" + human_bytes(capacity_) + ")"; }

size_t DevicePool::rounded_size(size_t bytes) {
  return bytes < kMinBlock ? kMinBlock : (bytes + kMinBlock - 1) / kMinBlock * kMinBlock;
}

size_t DevicePool::segment_size(size_t rounded) {
  if (rounded <= kSmallSize) return kSmallSegment;
  if (rounded < kMinLargeAlloc) return kLargeSegment;
  return (rounded + kRoundLarge - 1) / kRoundLarge * kRoundLarge;
}

DevicePool::DevicePool(std::unique_ptr<DeviceMemory> memory) : memory_(std::move(memory)) {}

DevicePool::~DevicePool() {
  for (auto& [addr, head] : segment_heads_) {
    size_t bytes = 0;
    for (Block* b = head; b != nullptr;) {
      bytes += b->size;
      Block* next = b->next;
      delete b;
      b = next;
    }
    memory_->unmap(reinterpret_cast<void*>(addr), bytes);
  }
}

DevicePool::Block* DevicePool::map_segment(size_t size, bool small) {
  void* p = memory_->map(size);
  if (p == nullptr) return nullptr;
  auto* b = new Block;
  b->addr = reinterpret_cast<uintptr_t>(p);
  b->size = size;
  b->small = small;
  segment_heads_[b->addr] = b;
  stats_.reserved += size;
  stats_.peak_reserved = std::max(stats_.peak_reserved, stats_.reserved);
  ++stats_.segments;
  ++stats_.num_maps;
  return b;
}

void DevicePool::release_free_segments() {
  for (auto it = segment_heads_.begin(); it != segment_heads_.end();) {
    Block* head = it->second;
    if (!head->free || head->next != nullptr) {  // something of it is live
      ++it;
      continue;
    }
    pool(head->small).erase(head);
    memory_->unmap(reinterpret_cast<void*>(head->addr), head->size);
    stats_.reserved -= head->size;
    --stats_.segments;
    ++stats_.num_unmaps;
    delete head;
    it = segment_heads_.erase(it);
  }
}

void* DevicePool::allocate(size_t bytes, MemCategory category, std::string_view tag) {
  const std::lock_guard lock(mutex_);
  const size_t size = rounded_size(bytes);
  const bool small = size <= kSmallSize;
  auto& free_blocks = pool(small);
  Block key;
  key.size = size;
  key.addr = 0;
  Block* b = nullptr;
  if (auto it = free_blocks.lower_bound(&key); it != free_blocks.end()) {
    b = *it;
    free_blocks.erase(it);
  } else {
    b = map_segment(segment_size(size), small);
    if (b == nullptr) {  // return what is cached, and try once more
      release_free_segments();
      b = map_segment(segment_size(size), small);
    }
    if (b == nullptr)
      throw OutOfMemoryError("out of device memory: " + std::string(tag) + " (" + category_name(category) +
                             ") asked for " + human_bytes(bytes) + " on " + memory_->name() + ", which holds " +
                             human_bytes(stats_.reserved) + " reserved by this pool, " +
                             human_bytes(stats_.allocated) + " of it allocated");
  }
  const size_t remaining = b->size - size;
  if (small ? remaining >= kMinBlock : remaining > kSmallSize) {
    auto* rest = new Block;
    rest->addr = b->addr + size;
    rest->size = remaining;
    rest->small = small;
    rest->prev = b;
    rest->next = b->next;
    if (b->next != nullptr) b->next->prev = rest;
    b->next = rest;
    b->size = size;
    free_blocks.insert(rest);
  }
  b->free = false;
  b->requested = bytes;
  b->category = category;
  b->tag = tag;
  live_[b->addr] = b;
  const auto c = static_cast<size_t>(category);
  stats_.live[c] += bytes;
  stats_.peak[c] = std::max(stats_.peak[c], stats_.live[c]);
  stats_.allocated += b->size;
  stats_.peak_allocated = std::max(stats_.peak_allocated, stats_.allocated);
  ++stats_.num_allocs;
  return reinterpret_cast<void*>(b->addr);
}

void DevicePool::absorb_next(Block* b) {
  Block* n = b->next;
  b->size += n->size;
  b->next = n->next;
  if (n->next != nullptr) n->next->prev = b;
  delete n;
}

void DevicePool::deallocate(void* ptr) {
  if (ptr == nullptr) return;
  const std::lock_guard lock(mutex_);
  const auto it = live_.find(reinterpret_cast<uintptr_t>(ptr));
  ANVIL_ASSERT(it != live_.end(), "device pool: freeing ", ptr, ", which it did not hand out");
  Block* b = it->second;
  live_.erase(it);
  stats_.live[static_cast<size_t>(b->category)] -= b->requested;
  stats_.allocated -= b->size;
  b->free = true;
  b->tag.clear();
  auto& free_blocks = pool(b->small);
  // Merge with free neighbours: the segment's free space stays in as few blocks as it can.
  if (Block* n = b->next; n != nullptr && n->free) {
    free_blocks.erase(n);
    absorb_next(b);
  }
  if (Block* p = b->prev; p != nullptr && p->free) {
    free_blocks.erase(p);
    absorb_next(p);
    b = p;
  }
  free_blocks.insert(b);
}

void DevicePool::empty_cache() {
  const std::lock_guard lock(mutex_);
  release_free_segments();
}

DevicePoolStats DevicePool::stats() const {
  const std::lock_guard lock(mutex_);
  return stats_;
}

void DevicePool::reset_peak() {
  const std::lock_guard lock(mutex_);
  stats_.peak = stats_.live;
  stats_.peak_allocated = stats_.allocated;
  stats_.peak_reserved = stats_.reserved;
}

}  // namespace anvil
