// The device pool: a caching allocator for an accelerator's memory, the GPU
// counterpart of the tracking allocator (core/allocator.h). Every device byte a
// tensor, a library workspace or a buffer takes comes from here, tagged with
// the same categories, so the device's live and peak bytes per category, its
// reserved bytes and their peak are known as exactly as the host's.
//
// It makes the same decisions as PyTorch's CUDA caching allocator, so that its
// reserved bytes are comparable with torch.cuda.max_memory_reserved() (facts
// of its design, c10/cuda/CUDACachingAllocator.cpp; no code of it):
//   - requests are rounded up to 512 bytes;
//   - requests up to 1 MiB come from the small pool, whose segments are 2 MiB;
//     larger ones from the large pool, whose segments are 20 MiB for requests
//     under 10 MiB and the request rounded up to 2 MiB above;
//   - a request takes the smallest cached block of its pool that holds it
//     (ties: the lowest address), and the block is split when what is left
//     is more than 512 bytes (small pool) or 1 MiB (large pool);
//   - a freed block merges with free neighbours of its segment and stays
//     cached; only empty_cache() (or a failed mapping, before retrying once)
//     returns whole free segments to the device.
// Segments come from a DeviceMemory: cudaMalloc on a GPU (cuda/), or a fake
// device that maps address ranges and no memory, for tests and for the dry
// run of a GPU job on a machine without one.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>

#include "anvil/core/allocator.h"

namespace anvil {

// Where the pool maps its segments from.
class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;
  // `bytes` of device memory, or null when the device has no room.
  virtual void* map(size_t bytes) = 0;
  virtual void unmap(void* ptr, size_t bytes) = 0;
  virtual std::string name() const = 0;  // "cuda:0 (NVIDIA H200)", "fake device (80.0 GiB)"
};

// A device of `capacity` bytes whose mappings are address ranges nothing can
// read or write: the pool's bookkeeping runs as on a real one.
class FakeDeviceMemory : public DeviceMemory {
 public:
  explicit FakeDeviceMemory(size_t capacity);
  void* map(size_t bytes) override;
  void unmap(void* ptr, size_t bytes) override;
  std::string name() const override;
  size_t mapped() const { return mapped_; }
  int64_t maps() const { return maps_; }  // how many mappings were made, in all

 private:
  size_t capacity_, mapped_ = 0;
  uintptr_t next_ = uintptr_t{1} << 44;  // addresses far from the host's, 2 MiB aligned
  int64_t maps_ = 0;
};

struct DevicePoolStats {
  std::array<size_t, kNumMemCategories> live{};  // requested bytes, per category
  std::array<size_t, kNumMemCategories> peak{};
  size_t allocated = 0, peak_allocated = 0;  // the blocks handed out (rounded): torch's memory_allocated
  size_t reserved = 0, peak_reserved = 0;    // the segments mapped: torch's memory_reserved
  int64_t segments = 0, num_allocs = 0, num_maps = 0, num_unmaps = 0;
};

// The pool's figures as the host allocator's (MemStats): per-category bytes
// as requested; the totals are the blocks handed out (torch's
// memory_allocated) and the segments mapped (memory_reserved).
MemStats mem_stats(const DevicePoolStats& s);

class DevicePool {
 public:
  explicit DevicePool(std::unique_ptr<DeviceMemory> memory);
  ~DevicePool();
  DevicePool(const DevicePool&) = delete;
  DevicePool& operator=(const DevicePool&) = delete;

  // 512-byte aligned device memory; throws OutOfMemoryError naming the
  // request, the device and what the pool holds when the device has no room
  // even after returning its free segments.
  void* allocate(size_t bytes, MemCategory category, std::string_view tag);
  void deallocate(void* ptr);
  // Returns every wholly free segment to the device (torch.cuda.empty_cache()).
  void empty_cache();
  // Peaks restart from what is live (torch.cuda.reset_peak_memory_stats()).
  void reset_peak();

  DevicePoolStats stats() const;
  const DeviceMemory& memory() const { return *memory_; }

  // The block sizes a request of `bytes` is rounded to, and the segment a
  // fresh mapping for it would have (exposed for tests and the estimator).
  static size_t rounded_size(size_t bytes);
  static size_t segment_size(size_t rounded);

 private:
  struct Block {
    uintptr_t addr = 0;
    size_t size = 0;
    bool small = false;  // which pool
    bool free = true;
    Block *prev = nullptr, *next = nullptr;  // neighbours in the segment
    size_t requested = 0;
    MemCategory category = MemCategory::workspace;
    std::string tag;
  };
  struct BySize {
    bool operator()(const Block* a, const Block* b) const {
      return a->size != b->size ? a->size < b->size : a->addr < b->addr;
    }
  };
  std::set<Block*, BySize>& pool(bool small) { return small ? small_free_ : large_free_; }
  Block* map_segment(size_t size, bool small);
  void absorb_next(Block* b);  // b takes its next neighbour's bytes (both out of the free pools)
  void release_free_segments();

  std::unique_ptr<DeviceMemory> memory_;
  // Tensors are freed on whatever thread drops their last view (the data
  // loader's, a checkpoint writer's), so every entry point takes the lock.
  mutable std::mutex mutex_;
  std::set<Block*, BySize> small_free_, large_free_;
  std::unordered_map<uintptr_t, Block*> live_;      // handed-out blocks by address
  std::map<uintptr_t, Block*> segment_heads_;       // every segment's first block
  DevicePoolStats stats_;
};

}  // namespace anvil
