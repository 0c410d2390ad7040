// Core: tensors, the tracking allocator, the counter-based RNG, parallel_for.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>

#include "anvil/core/allocator.h"
#include "anvil/core/parallel_for.h"
#include "anvil/core/rng.h"
#include "anvil/core/tensor.h"

using namespace anvil;

TEST(Allocator, TracksLiveAndPeakPerCategory) {
  auto& a = TrackingAllocator::instance();
  const size_t act0 = a.live_bytes(MemCategory::activations);
  const size_t par0 = a.live_bytes(MemCategory::parameters);
  a.reset_peak();
  {
    Tensor p = Tensor::empty({100, 10}, DType::f32, MemCategory::parameters, "p");
    {
      Tensor x = Tensor::empty({1000}, DType::bf16, MemCategory::activations, "x");
      EXPECT_EQ(a.live_bytes(MemCategory::activations), act0 + 2000);
      EXPECT_EQ(a.live_bytes(MemCategory::parameters), par0 + 4000);
    }
    EXPECT_EQ(a.live_bytes(MemCategory::activations), act0);
    EXPECT_EQ(a.peak_bytes(MemCategory::activations), act0 + 2000);
    Tensor view = p.slice(10, 5);  // a view allocates nothing
    EXPECT_EQ(a.live_bytes(MemCategory::parameters), par0 + 4000);
    EXPECT_EQ(view.numel(), 50);
  }
  EXPECT_EQ(a.live_bytes(MemCategory::parameters), par0);
  EXPECT_GE(a.peak_total(), 6000u);
  a.reset_peak();
  EXPECT_EQ(a.peak_bytes(MemCategory::activations), a.live_bytes(MemCategory::activations));
}

TEST(Allocator, PeakTotalIsPeakOfTheSum) {
  auto& a = TrackingAllocator::instance();
  a.reset_peak();
  const size_t base = a.live_total();
  { Tensor x = Tensor::empty({1024}, DType::f32, MemCategory::activations, "x"); }
  { Tensor g = Tensor::empty({1024}, DType::f32, MemCategory::gradients, "g"); }
  // Never both live at once: the total peak is one of them, not their sum.
  EXPECT_EQ(a.peak_total(), base + 4096);
}

TEST(Allocator, TimelineRecordsEventsWithTagAndSize) {
  auto& a = TrackingAllocator::instance();
  a.clear_timeline();
  a.set_timeline(true);
  { Tensor x = Tensor::empty({7, 3}, DType::f32, MemCategory::workspace, "scratch"); }
  a.set_timeline(false);
  { Tensor y = Tensor::empty({5}, DType::f32, MemCategory::workspace, "untracked"); }
  auto events = a.timeline();
  ASSERT_EQ(events.size(), 2u);
  EXPECT_TRUE(events[0].is_alloc);
  EXPECT_FALSE(events[1].is_alloc);
  EXPECT_EQ(events[0].tag, "scratch");
  EXPECT_EQ(events[0].bytes, 84u);
  EXPECT_EQ(events[0].category, MemCategory::workspace);
  EXPECT_LE(events[0].time_us, events[1].time_us);
}

TEST(Allocator, LargestLiveNamesTheOwner) {
  Tensor big = Tensor::empty({1 << 20}, DType::f32, MemCategory::optimizer_state, "adam.m");
  auto top = TrackingAllocator::instance().largest_live(1);
  ASSERT_EQ(top.size(), 1u);
  EXPECT_EQ(top[0].tag, "adam.m");
  EXPECT_EQ(top[0].bytes, 4u << 20);
}

TEST(Tensor, ViewsShareMemoryAndConvert) {
  Tensor t = Tensor::empty({4, 3}, DType::f32, MemCategory::workspace, "t");
  for (int i = 0; i < 12; ++i) t.data<float>()[i] = static_cast<float>(i) + 0.5f;
  Tensor row = t.slice(2, 1);
  EXPECT_EQ(row.data<float>()[0], 6.5f);
  Tensor b = t.to(DType::bf16, MemCategory::workspace, "b");
  EXPECT_EQ(b.nbytes(), 24u);
  EXPECT_EQ(b.item_f32(5), 5.5f);  // exactly representable in bf16
  Tensor v = t.view({3, 4});
  EXPECT_EQ(v.size(-1), 4);
}

TEST(BF16, RoundsToNearestEven) {
  EXPECT_EQ(bf16::from_float(1.0f), 0x3f80);
  // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
  EXPECT_EQ(bf16::from_float(1.0f + 1.0f / 256), 0x3f80);
  // 1 + 3*2^-8 lies halfway between 1 + 2^-7 and 1 + 2^-6: ties go to even (1 + 2^-6).
  EXPECT_EQ(bf16::from_float(1.0f + 3.0f / 256), 0x3f82);
  EXPECT_TRUE(std::isnan(bf16::to_float(bf16::from_float(NAN))));
  EXPECT_EQ(bf16::to_float(bf16::from_float(-2.5f)), -2.5f);
}

TEST(Rng, ShardsMatchTheWholeTensor) {
  Tensor whole = Tensor::empty({1000}, DType::f32, MemCategory::parameters, "w");
  fill_normal(whole, {42, "layers.0.w"}, 0.0f, 0.02f);
  Tensor shard = Tensor::empty({250}, DType::f32, MemCategory::parameters, "w_shard");
  fill_normal(shard, {42, "layers.0.w"}, 0.0f, 0.02f, /*offset=*/500);
  for (int i = 0; i < 250; ++i) EXPECT_EQ(shard.data<float>()[i], whole.data<float>()[500 + i]);
  // Another name or seed gives another stream.
  Tensor other = Tensor::empty({1000}, DType::f32, MemCategory::parameters, "o");
  fill_normal(other, {42, "layers.1.w"}, 0.0f, 0.02f);
  EXPECT_NE(other.data<float>()[0], whole.data<float>()[0]);
}

TEST(Rng, NormalHasTheRightMoments) {
  const int n = 200000;
  Tensor t = Tensor::empty({n}, DType::f32, MemCategory::workspace, "t");
  fill_normal(t, {7, "moments"}, 1.0f, 2.0f);
  double sum = 0, sq = 0;
  for (int i = 0; i < n; ++i) sum += t.data<float>()[i], sq += double(t.data<float>()[i]) * t.data<float>()[i];
  const double mean = sum / n, var = sq / n - mean * mean;
  EXPECT_NEAR(mean, 1.0, 0.02);  // 5 standard errors: 2/sqrt(2e5) = 0.0045
  EXPECT_NEAR(std::sqrt(var), 2.0, 0.02);
  fill_trunc_normal(t, {7, "trunc"}, 0.0f, 1.0f, -2.0f, 2.0f);
  for (int i = 0; i < n; ++i) ASSERT_LE(std::abs(t.data<float>()[i]), 2.0f);
}

TEST(Rng, PhiloxKnownAnswer) {
  // Random123's published known-answer test for philox4x32_10, counter and key all zero.
  // Our key packs (k0, k1) from a 64-bit value and the counter from two 64-bit halves.
  auto r = philox4x32(0, 0, 0);
  EXPECT_EQ(r[0], 0x6627e8d5u);
  EXPECT_EQ(r[1], 0xe169c58du);
  EXPECT_EQ(r[2], 0xbc57ac4cu);
  EXPECT_EQ(r[3], 0x9b00dbd8u);
}

TEST(ParallelDims, CoversTheRangeExactlyOnce) {
  std::vector<std::atomic<int>> hits(10007);
  parallel_for(0, 10007, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) hits[i]++;
  });
  for (auto& h : hits) EXPECT_EQ(h.load(), 1);
}
