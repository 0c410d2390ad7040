// The device pool (core/device_pool.h) on a fake device: the caching
// allocator's decisions — rounding, which pool, segment sizes, best fit,
// splitting, merging, returning segments — and its counts, each checked
// against the figure its rule gives, written out here by hand.
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "anvil/core/device_pool.h"

namespace anvil {
namespace {

constexpr size_t KiB = size_t{1} << 10, MiB = size_t{1} << 20;

struct Pool {
  FakeDeviceMemory* device;
  DevicePool pool;
  explicit Pool(size_t capacity = 80 * 1024 * MiB)
      : device(new FakeDeviceMemory(capacity)), pool(std::unique_ptr<DeviceMemory>(device)) {}
  void* get(size_t bytes, MemCategory c = MemCategory::activations) { return pool.allocate(bytes, c, "t"); }
};

uintptr_t addr(void* p) { return reinterpret_cast<uintptr_t>(p); }

TEST(DevicePool, SizesRoundTo512AndSegmentsFollowThePools) {
  EXPECT_EQ(DevicePool::rounded_size(0), 512u);
  EXPECT_EQ(DevicePool::rounded_size(1), 512u);
  EXPECT_EQ(DevicePool::rounded_size(512), 512u);
  EXPECT_EQ(DevicePool::rounded_size(513), 1024u);
  EXPECT_EQ(DevicePool::segment_size(512), 2 * MiB);         // small pool
  EXPECT_EQ(DevicePool::segment_size(1 * MiB), 2 * MiB);     // still small
  EXPECT_EQ(DevicePool::segment_size(MiB + 512), 20 * MiB);  // large, under 10 MiB: a shared 20 MiB segment
  EXPECT_EQ(DevicePool::segment_size(10 * MiB - 512), 20 * MiB);
  EXPECT_EQ(DevicePool::segment_size(10 * MiB), 10 * MiB);  // 10 MiB and up: its own, rounded to 2 MiB
  EXPECT_EQ(DevicePool::segment_size(10 * MiB + 512), 12 * MiB);
}

TEST(DevicePool, SmallRequestsShareASegmentAndFreedBlocksAreReused) {
  Pool p;
  std::vector<void*> got;
  for (int i = 0; i < 4; ++i) got.push_back(p.get(1000));  // 1024 each
  DevicePoolStats s = p.pool.stats();
  EXPECT_EQ(s.segments, 1);
  EXPECT_EQ(s.reserved, 2 * MiB);
  EXPECT_EQ(s.allocated, 4 * KiB);
  EXPECT_EQ(s.live[static_cast<size_t>(MemCategory::activations)], 4000u);  // requested bytes, by category
  for (int i = 1; i < 4; ++i) EXPECT_EQ(addr(got[static_cast<size_t>(i)]), addr(got[0]) + 1024 * static_cast<size_t>(i));
  p.pool.deallocate(got[1]);
  void* again = p.get(700);  // 1024: the freed block is the smallest that holds it
  EXPECT_EQ(again, got[1]);
  EXPECT_EQ(p.device->maps(), 1);
  EXPECT_EQ(p.pool.stats().num_allocs, 5);
}

TEST(DevicePool, LargeBlocksSplitOnlyWhenMoreThanOneMiBIsLeft) {
  Pool p;
  void* a = p.get(3 * MiB);  // a 20 MiB segment, split: 17 MiB left free
  void* b = p.get(5 * MiB);  // from that remainder: 12 MiB left
  EXPECT_EQ(addr(b), addr(a) + 3 * MiB);
  const size_t near = 12 * MiB - 600 * KiB;  // the 12 MiB block holds it, 600 KiB would be left: not split
  void* c = p.get(near);
  EXPECT_EQ(addr(c), addr(b) + 5 * MiB);
  EXPECT_EQ(p.device->maps(), 1);
  DevicePoolStats s = p.pool.stats();
  EXPECT_EQ(s.allocated, 20 * MiB);  // the whole segment is handed out: c's block is 12 MiB
  EXPECT_EQ(s.reserved, 20 * MiB);
  // A request the cache cannot hold maps a segment of its own size, rounded to 2 MiB.
  p.get(25 * MiB + 1);
  EXPECT_EQ(p.device->maps(), 2);
  EXPECT_EQ(p.pool.stats().reserved, 20 * MiB + 26 * MiB);
}

TEST(DevicePool, FreedNeighboursMergeAndTheBestFitWins) {
  Pool p;
  void* a = p.get(4 * MiB);
  void* b = p.get(4 * MiB);
  void* c = p.get(4 * MiB);  // 8 MiB of the segment still free after c
  p.pool.deallocate(a);
  p.pool.deallocate(b);  // a and b merge: one 8 MiB free block at a
  // Two free 8 MiB blocks (a+b, and the tail after c): the lower address wins the tie.
  void* d = p.get(7 * MiB);
  EXPECT_EQ(d, a);
  // 1 MiB is left after d: not split (a large block splits only above 1 MiB), so d's block is 8 MiB.
  EXPECT_EQ(p.pool.stats().allocated, 8 * MiB + 4 * MiB);
  p.pool.deallocate(c);  // c merges with the free tail: 12 MiB free after d
  void* e = p.get(2 * MiB);
  EXPECT_EQ(e, c);
  EXPECT_EQ(p.device->maps(), 1);
}

TEST(DevicePool, TheSmallestBlockThatFitsWinsOverAnEarlierLargerOne) {
  Pool p;
  p.get(2 * MiB);            // [0, 2) of a 20 MiB segment
  void* b = p.get(9 * MiB);  // [2, 11)
  void* c = p.get(2 * MiB);  // [11, 13); 7 MiB free at 13
  p.pool.deallocate(b);      // free: 9 MiB at 2, 7 MiB at 13
  void* d = p.get(6 * MiB);
  EXPECT_EQ(addr(d), addr(c) + 2 * MiB);
  EXPECT_EQ(p.device->maps(), 1);
}

TEST(DevicePool, EmptyCacheReturnsOnlyWhollyFreeSegments) {
  Pool p;
  void* big = p.get(30 * MiB);  // its own 30 MiB segment
  void* x = p.get(2 * MiB);     // a 20 MiB segment
  void* y = p.get(2 * MiB);     // the same one
  EXPECT_EQ(p.pool.stats().reserved, 50 * MiB);
  p.pool.deallocate(big);
  p.pool.deallocate(x);
  EXPECT_EQ(p.pool.stats().reserved, 50 * MiB);  // freed blocks stay cached
  p.pool.empty_cache();
  DevicePoolStats s = p.pool.stats();
  EXPECT_EQ(s.reserved, 20 * MiB);  // y keeps its segment
  EXPECT_EQ(s.segments, 1);
  EXPECT_EQ(s.num_unmaps, 1);
  EXPECT_EQ(p.device->mapped(), 20 * MiB);
  EXPECT_EQ(s.peak_reserved, 50 * MiB);
  p.pool.deallocate(y);
  p.pool.empty_cache();
  EXPECT_EQ(p.pool.stats().reserved, 0u);
  EXPECT_EQ(p.device->mapped(), 0u);
}

TEST(DevicePool, AFullDeviceReturnsTheCacheFirstThenRefusesByName) {
  Pool p(64 * MiB);
  void* a = p.get(40 * MiB);
  p.pool.deallocate(a);        // 40 MiB cached
  void* b = p.get(50 * MiB);   // 40 + 50 > 64: the cached segment goes back, then it fits
  EXPECT_EQ(p.pool.stats().num_unmaps, 1);
  EXPECT_EQ(p.pool.stats().reserved, 50 * MiB);
  try {
    p.pool.allocate(30 * MiB, MemCategory::parameters, "layers.3.w1");
    FAIL() << "a 30 MiB request fitted in 14 MiB";
  } catch (const OutOfMemoryError& e) {
    const std::string msg = e.what();
    for (const char* want : {"out of device memory", "layers.3.w1", "parameters", "30.0 MiB", "fake device (64.0 MiB)",
                             "50.0 MiB reserved"})
      EXPECT_NE(msg.find(want), std::string::npos) << want << " not in: " << msg;
  }
  p.pool.deallocate(b);
}

TEST(DevicePool, CategoriesCountRequestedBytesAndPeaksReset) {
  Pool p;
  void* w = p.get(3000, MemCategory::parameters);
  void* g = p.get(5 * MiB, MemCategory::gradients);
  void* t = p.get(1 * MiB, MemCategory::activations);
  p.pool.deallocate(t);
  DevicePoolStats s = p.pool.stats();
  auto at = [](const std::array<size_t, kNumMemCategories>& a, MemCategory c) { return a[static_cast<size_t>(c)]; };
  EXPECT_EQ(at(s.live, MemCategory::parameters), 3000u);
  EXPECT_EQ(at(s.live, MemCategory::gradients), 5 * MiB);
  EXPECT_EQ(at(s.live, MemCategory::activations), 0u);
  EXPECT_EQ(at(s.peak, MemCategory::activations), 1 * MiB);
  EXPECT_EQ(s.allocated, 3072 + 5 * MiB);
  EXPECT_EQ(s.peak_allocated, 3072 + 6 * MiB);
  p.pool.reset_peak();
  s = p.pool.stats();
  EXPECT_EQ(at(s.peak, MemCategory::activations), 0u);
  EXPECT_EQ(s.peak_allocated, s.allocated);
  EXPECT_EQ(s.peak_reserved, s.reserved);
  p.pool.deallocate(w);
  p.pool.deallocate(g);
}

// A bug in the caller, not a user's error: the process stops naming it.
TEST(DevicePoolDeathTest, FreeingAnAddressItDidNotHandOutStopsTheProcess) {
  Pool p;
  int x = 0;
  EXPECT_DEATH(p.pool.deallocate(&x), "which it did not hand out");
}

}  // namespace
}  // namespace anvil
