// One process's bf16 weights cast per group while it runs (model/cast_on_use.h)
// against a kept whole bf16 copy: the same loss and gradients bit for bit
// (the same master rounded the same way), and the parameters' memory the
// closed form says — the master, plus the casts of the groups in use.
#include <gtest/gtest.h>

#include <algorithm>

#include "anvil/core/allocator.h"
#include "anvil/model/llama.h"
#include "test_util.h"

using namespace anvil;
using namespace anvil::testing;

namespace {

ModelArgs small_llama(bool tied) {
  ModelArgs args = model_flavor("llama3", "debugmodel");
  args.dim = 64, args.n_heads = 4, args.n_kv_heads = 2, args.n_layers = 4, args.vocab_size = 96;
  args.tie_embeddings = tied;
  return args;
}

const AcPolicy kPolicies[] = {{AcMode::none, 1}, {AcMode::selective_op, 1}, {AcMode::selective_layer, 2}, {AcMode::full, 1}};
const ReshardPolicy kReshard[] = {ReshardPolicy::default_policy, ReshardPolicy::always, ReshardPolicy::never};

size_t live_parameter_bytes() { return TrackingAllocator::instance().live_bytes(MemCategory::parameters); }

}  // namespace

TEST(CastOnUse, GradientsEqualAKeptBf16CopyBitForBit) {
  const int64_t B = 2, T = 32;
  for (const bool tied : {false, true}) {
    const ModelArgs args = small_llama(tied);
    Tensor tokens, targets;
    make_batch(B, T, args.vocab_size, tokens, targets);
    Llama whole(args, DType::bf16, T);
    whole.params().init(7);
    for (const AcPolicy& policy : kPolicies)
      for (const ReshardPolicy reshard : kReshard) {
        SCOPED_TRACE(std::string(tied ? "tied, " : "") + ac_mode_name(policy.mode) + ", reshard " +
                     std::to_string(static_cast<int>(reshard)));
        Llama cast(args, DType::bf16, T, LlamaOptions{.compute_copy = ComputeCopy::per_group, .cast_reshard = reshard});
        cast.params().init(7);
        const size_t before = live_parameter_bytes();
        whole.params().zero_grad();
        cast.params().zero_grad();
        const CrossEntropyResult a = whole.forward_backward(tokens, targets, 1.0f / (B * T), policy);
        const CrossEntropyResult b = cast.forward_backward(tokens, targets, 1.0f / (B * T), policy);
        EXPECT_EQ(a.loss_sum, b.loss_sum);
        EXPECT_TRUE(same_bytes(whole.params().grad_flat(), cast.params().grad_flat())) << "gradients differ";
        EXPECT_EQ(live_parameter_bytes(), before) << "a cast outlived its group's backward";
      }
  }
}

// The peak of the parameters' bytes over a forward and backward, above the
// fp32 master: by default the last block's cast kept for its backward beside
// the head's (and, tied, the embedding's, which the head reads); "always"
// one group at a time; "never" every block's, kept until its backward.
TEST(CastOnUse, ParameterPeakIsTheMasterAndTheGroupsInUse) {
  const int64_t B = 2, T = 32;
  for (const bool tied : {false, true})
    for (const ReshardPolicy reshard : kReshard) {
      SCOPED_TRACE(std::string(tied ? "tied, " : "") + "reshard " + std::to_string(static_cast<int>(reshard)));
      const ModelArgs args = small_llama(tied);
      Tensor tokens, targets;
      make_batch(B, T, args.vocab_size, tokens, targets);
      Llama cast(args, DType::bf16, T, LlamaOptions{.compute_copy = ComputeCopy::per_group, .cast_reshard = reshard});
      cast.params().init(7);
      cast.params().zero_grad();
      const std::vector<ParamGroup>& groups = cast.params().groups();
      const size_t master = static_cast<size_t>(cast.params().numel()) * 4;
      int64_t largest_block = 0, blocks = 0;
      for (const ParamGroup& g : groups)
        if (g.module == ModuleKind::block) largest_block = std::max(largest_block, g.numel), blocks += g.numel;
      const int64_t head = groups.back().numel + (tied ? groups.front().numel : 0);
      const int64_t last_block = groups[groups.size() - 2].numel;
      int64_t cast_elements = 0;
      switch (reshard) {
        case ReshardPolicy::default_policy: cast_elements = std::max(largest_block, last_block + head); break;
        case ReshardPolicy::always: cast_elements = std::max(largest_block, head); break;
        case ReshardPolicy::never: cast_elements = blocks + head; break;
      }
      TrackingAllocator& alloc = TrackingAllocator::instance();
      ASSERT_EQ(live_parameter_bytes(), master) << "only this model's master weights are live";
      alloc.reset_peak();
      cast.forward_backward(tokens, targets, 1.0f / (B * T), AcPolicy{});
      EXPECT_EQ(alloc.peak_bytes(MemCategory::parameters), master + static_cast<size_t>(cast_elements) * 2);
      EXPECT_EQ(live_parameter_bytes(), master);
    }
}
