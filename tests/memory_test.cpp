// Memory: the estimator against the tracking allocator, the ordering of the
// activation-checkpointing modes, and flat memory under gradient accumulation.
#include <gtest/gtest.h>

#include "anvil/core/rng.h"
#include "anvil/model/llama.h"
#include "anvil/plan/memory.h"

using namespace anvil;

namespace {

constexpr int64_t kB = 2, kT = 64;

std::pair<Tensor, Tensor> batch(int64_t vocab, uint64_t seed) {
  Tensor tokens = Tensor::empty({kB, kT}, DType::i32, MemCategory::workspace, "tokens");
  Tensor targets = Tensor::empty({kB, kT}, DType::i32, MemCategory::workspace, "targets");
  const uint64_t key = RngStream{seed, "memory.tokens"}.key();
  for (int64_t i = 0; i < kB * kT; ++i) {
    tokens.data<int32_t>()[i] = static_cast<int32_t>(uniform01(key, static_cast<uint64_t>(i)) * vocab);
    targets.data<int32_t>()[i] = static_cast<int32_t>(uniform01(key, static_cast<uint64_t>(i + kB * kT)) * vocab);
  }
  return {tokens, targets};
}

// Peak activation bytes of one forward_backward, as the allocator saw them.
size_t measured_activation_peak(Llama& model, const AcPolicy& policy) {
  auto [tokens, targets] = batch(model.args().vocab_size, 1);
  auto& alloc = TrackingAllocator::instance();
  alloc.reset_peak();
  const size_t before = alloc.live_bytes(MemCategory::activations);
  model.forward_backward(tokens, targets, 1.0f, policy);
  EXPECT_EQ(alloc.live_bytes(MemCategory::activations), before) << "activations leaked";
  return alloc.peak_bytes(MemCategory::activations) - before;
}

ModelArgs small_model() {
  ModelArgs a = model_flavor("llama3", "debugmodel");
  a.n_layers = 4;
  return a;
}

const AcPolicy kPolicies[] = {{AcMode::none, 1}, {AcMode::selective_op, 1}, {AcMode::selective_layer, 2},
                              {AcMode::full, 1}};

}  // namespace

TEST(MemoryEstimate, MatchesTheAllocatorPerCategory) {
  for (DType dt : {DType::f32, DType::bf16}) {
    const ModelArgs args = small_model();
    auto& alloc = TrackingAllocator::instance();
    const size_t params_before = alloc.live_bytes(MemCategory::parameters);
    Llama model(args, dt, kT);
    model.params().init(1);
    for (const AcPolicy& p : kPolicies) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + " " + ac_mode_name(p.mode));
      const MemoryEstimate est = estimate_memory(args, {kB, kT, dt, p});
      EXPECT_EQ(measured_activation_peak(model, p), est.bytes(MemCategory::activations));
      // The parameter buffers (plus the RoPE table, which is workspace) are all that the model holds.
      EXPECT_EQ(alloc.live_bytes(MemCategory::parameters) - params_before, est.bytes(MemCategory::parameters));
      EXPECT_EQ(model.params().grad_flat().nbytes(), est.bytes(MemCategory::gradients));
    }
  }
}

TEST(MemoryEstimate, CheckpointingModesOrderAsDocumented) {
  const ModelArgs args = small_model();
  Llama model(args, DType::bf16, kT);
  model.params().init(1);
  size_t peak[4];
  for (int i = 0; i < 4; ++i) peak[i] = measured_activation_peak(model, kPolicies[i]);
  std::printf("activation peak: none %zu, selective op %zu, selective layer(2) %zu, full %zu bytes\n", peak[0],
              peak[1], peak[2], peak[3]);
  EXPECT_GT(peak[0], peak[1]);
  EXPECT_GT(peak[1], peak[2]);
  EXPECT_GT(peak[2], peak[3]);

  // Full: one block input per layer, plus one block's working set.
  const size_t inputs = static_cast<size_t>(args.n_layers * kB * kT * args.dim) * 2;
  const size_t block = block_saved_bytes(args, {kB, kT, DType::bf16, {AcMode::none, 1}}, 0);
  std::printf("full: %zu = %zu block inputs + %zu; one block's saved tensors %zu\n", peak[3], inputs,
              peak[3] - inputs, block);
  EXPECT_GE(peak[3], inputs + block);
  // The working set beyond the block's own tensors is a few (M, D) or (M, F) gradients.
  EXPECT_LE(peak[3], inputs + block + block / 2);
}

TEST(GradientAccumulation, PeakMemoryIsFlatInTheNumberOfMicroBatches) {
  const ModelArgs args = small_model();
  Llama model(args, DType::bf16, kT);
  model.params().init(1);
  auto& alloc = TrackingAllocator::instance();
  size_t peak_one = 0;
  for (int micro_batches : {1, 2, 4, 8}) {
    model.params().zero_grad();
    alloc.reset_peak();
    for (int i = 0; i < micro_batches; ++i) {
      auto [tokens, targets] = batch(args.vocab_size, static_cast<uint64_t>(i));
      model.forward_backward(tokens, targets, 1.0f / static_cast<float>(micro_batches), {AcMode::none, 1});
    }
    const size_t peak = alloc.peak_total();
    if (micro_batches == 1) peak_one = peak;
    std::printf("%d micro-batches: peak %zu bytes\n", micro_batches, peak);
    EXPECT_LE(static_cast<double>(peak), 1.02 * static_cast<double>(peak_one));
  }
}
