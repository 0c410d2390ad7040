// The tracking allocator: every tensor byte in Anvil is allocated here, tagged
// with a category, so live and peak memory per category are always known and
// the estimator's predictions can be checked against what really happened.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "anvil/core/error.h"
#include "anvil/core/profiler.h"

namespace anvil {

enum class MemCategory : uint8_t {
  parameters,
  gradients,
  optimizer_state,
  activations,
  communication,
  workspace,
};
inline constexpr int kNumMemCategories = 6;
const char* category_name(MemCategory c);

// "512.0 KiB", "47.0 MiB", "1.60 GiB": how every byte count reaches the user
// (logs, errors, the estimator's table).
std::string human_bytes(size_t bytes);

// Thrown when the system refuses an allocation; the trainer catches it to dump
// a memory snapshot of what was live.
class OutOfMemoryError : public Error {
 public:
  using Error::Error;
};

struct MemEvent {
  double time_us;        // steady clock, µs (the profiler's clock)
  bool is_alloc;         // false: a free
  MemCategory category;
  size_t bytes;
  std::string tag;
  size_t live_total;     // all categories, after the event
  const void* ptr;       // pairs a free with its allocation
  Phase phase;           // the phase that made the allocation
};

struct LiveAllocation {
  size_t bytes;
  MemCategory category;
  std::string tag;
  Phase phase;           // the phase that made it
  const void* ptr;
};

struct MemStats {
  std::array<size_t, kNumMemCategories> live{};
  std::array<size_t, kNumMemCategories> peak{};  // per category, since the last reset
  size_t live_total = 0;
  size_t peak_total = 0;  // peak of the sum, not the sum of the peaks
  size_t num_allocs = 0;  // allocations since creation
  // What the process holds for tensors: small allocations' bytes, and the
  // blocks of large ones, live or cached (see kCachedBlockMin).
  size_t reserved = 0;
  size_t peak_reserved = 0;  // since the last reset
  size_t cached = 0;         // of reserved: freed blocks waiting for reuse
};

// Allocations of at least this many bytes are blocks of whole pages mapped
// from the kernel. A freed block waits in a cache, by its exact size, for the
// next request of that size: a training step asks for the same sizes in the
// same order every time, so after the first step its tensors reuse the
// previous step's pages instead of faulting fresh zeroed ones in, and the
// process's resident memory is what the estimator's replay predicts (the
// reserved bytes) rather than whatever the C library's heap fragments into.
// Blocks above kCachedBlockMax go back to the kernel when freed, as the C
// library's would: a model's few largest buffers (an embedding's gradients, a
// gathered output head) would otherwise wait in the cache beside the peak.
inline constexpr size_t kCachedBlockMin = size_t{256} << 10;
inline constexpr size_t kCachedBlockMax = size_t{32} << 20;
// The block an allocation of `bytes` takes: whole pages when it is at least
// kCachedBlockMin, else 0 (the C library's heap serves it).
size_t cached_block_bytes(size_t bytes);

class TrackingAllocator {
 public:
  // The allocator in use: the process's, or a dry run's while one is on
  // (core/dry_run.h). Tensors go back to the allocator that made them.
  static TrackingAllocator& instance();
  // A dry allocator records every allocation exactly as the process's does
  // (tags, categories, bytes, the block cache, the timeline) but commits no
  // memory: a large allocation is an address no mapping can hold, so code
  // that would touch it faults, and a small one a heap block nobody reads.
  // Made by core/dry_run.h's DryRun.
  explicit TrackingAllocator(bool dry);
  ~TrackingAllocator();
  TrackingAllocator(const TrackingAllocator&) = delete;
  TrackingAllocator& operator=(const TrackingAllocator&) = delete;
  bool dry() const { return dry_; }

  // 64-byte aligned; never returns null (throws anvil::Error when out of memory).
  void* allocate(size_t bytes, MemCategory category, std::string_view tag);
  void deallocate(void* ptr);

  MemStats stats() const;
  size_t live_bytes(MemCategory c) const;
  size_t peak_bytes(MemCategory c) const;
  size_t live_total() const;
  size_t peak_total() const;
  // Peaks restart from the current live bytes.
  void reset_peak();
  // Returns to the kernel the cached blocks of every size not requested since
  // the previous trim (the trainer trims after each step), or every cached
  // block (around one-off work such as a checkpoint save).
  void trim_cache();
  void release_cache();

  // The timeline records every allocation and free while switched on.
  void set_timeline(bool on);
  bool timeline_on() const;
  std::vector<MemEvent> timeline() const;
  void clear_timeline();

  // The largest live allocations, largest first.
  std::vector<LiveAllocation> largest_live(size_t count) const;
  // Every live allocation, in no particular order.
  std::vector<LiveAllocation> live_allocations() const;

 private:
  friend class DryRun;
  // Makes `a` the allocator in use (null: the process's); returns the one before.
  static TrackingAllocator* install(TrackingAllocator* a);
  void* map_block(size_t block) const;
  void release_blocks(const std::vector<std::pair<void*, size_t>>& blocks);
  bool dry_ = false;
  mutable std::mutex mutex_;
  MemStats stats_;
  std::unordered_map<size_t, std::vector<void*>> free_blocks_;  // by block size
  std::unordered_map<size_t, bool> requested_since_trim_;       // block sizes
  std::unordered_map<void*, LiveAllocation> live_;
  bool timeline_on_ = false;
  std::vector<MemEvent> timeline_;
};

}  // namespace anvil
