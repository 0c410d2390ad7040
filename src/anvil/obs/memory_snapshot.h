// Memory snapshots: the largest live tensors at a moment that matters — the
// peak of a profiled step, or the allocation that failed — with the name,
// category, size and the phase that allocated each. The peak is found by
// replaying the allocator's timeline from the live set at the step's start, so
// recording costs nothing beyond the timeline itself.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "anvil/core/allocator.h"

namespace anvil {

struct SnapshotEntry {
  std::string name;
  MemCategory category;
  size_t bytes;
  std::string phase;  // "layers.3.attention.forward"; "(none)" when made outside any phase
};

struct MemorySnapshot {
  int64_t step = 0;
  std::string reason;  // "peak" or "out_of_memory"
  size_t total_bytes = 0;
  std::array<size_t, kNumMemCategories> by_category{};
  size_t num_live = 0;
  std::vector<SnapshotEntry> largest;  // largest first
  double time_us = 0;                  // when it was taken (steady clock)
  // A job on a GPU: its device pool's figures when the snapshot is written
  // (core/device_pool.h's mem_stats: peaks since the last log line); the
  // tensors listed above are the host allocator's.
  std::string device;  // "cuda:0"; "" for a job on the host
  MemStats device_stats;
};

// Fills s.device and s.device_stats when the calling thread's default device is a GPU.
void add_device_pool(MemorySnapshot& s);

// The live set at the highest point of `events`, given what was live before them.
MemorySnapshot snapshot_at_peak(const std::vector<LiveAllocation>& live_before, const std::vector<MemEvent>& events,
                                size_t top_k);
// What is live now.
MemorySnapshot snapshot_now(const std::vector<LiveAllocation>& live, size_t top_k);

// As JSON, written atomically (tmp + rename); throws anvil::Error naming the path.
void write_memory_snapshot(const MemorySnapshot& s, const std::string& path);

}  // namespace anvil
