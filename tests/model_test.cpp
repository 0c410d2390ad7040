// Whole-model properties: determinism of forward and backward across runs, and
// the modules run piecewise — a block's backward in two passes, the model as
// two pipeline stages — equal to the whole.
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "anvil/core/allocator.h"
#include "anvil/core/rng.h"
#include "anvil/estimate/flops.h"
#include "anvil/model/llama.h"
#include "test_util.h"

using namespace anvil;
using namespace anvil::testing;

// The same inputs must give bit-identical gradients on every run, whatever the
// thread timing: any difference is a race in a kernel.
TEST(Llama, BackwardIsBitwiseReproducible) {
  for (DType dt : {DType::bf16, DType::f32}) {
    const ModelArgs args = model_flavor("llama3", "debugmodel");
    const int64_t B = 4, T = 256;
    Llama model(args, dt, T);
    model.params().init(0);
    Tensor tokens = Tensor::empty({B, T}, DType::i32, MemCategory::workspace, "tokens");
    Tensor targets = Tensor::empty({B, T}, DType::i32, MemCategory::workspace, "targets");
    const uint64_t key = RngStream{0, "determinism"}.key();
    for (int64_t i = 0; i < B * T; ++i) {
      tokens.data<int32_t>()[i] = static_cast<int32_t>(uniform01(key, static_cast<uint64_t>(i)) * 258);
      targets.data<int32_t>()[i] = static_cast<int32_t>(uniform01(key, static_cast<uint64_t>(i + B * T)) * 258);
    }
    std::vector<std::vector<double>> runs;
    for (int run = 0; run < 3; ++run) {
      model.params().zero_grad();
      model.forward_backward(tokens, targets, 1.0f / static_cast<float>(B * T), AcPolicy{});
      std::vector<double> g;
      runs.push_back(to_double(model.params().grad_flat()));
    }
    const auto& specs = model.params().specs();
    for (int run = 1; run < 3; ++run)
      for (const ParamSpec& s : specs) {
        double diff = 0;
        for (int64_t i = s.offset; i < s.offset + s.numel(); ++i)
          diff = std::max(diff, std::abs(runs[run][static_cast<size_t>(i)] - runs[0][static_cast<size_t>(i)]));
        EXPECT_EQ(diff, 0.0) << dtype_name(dt) << " run " << run << ": " << s.name;
      }
  }
}

namespace {

ModelArgs small_llama() {
  ModelArgs args = model_flavor("llama3", "debugmodel");
  args.dim = 64, args.n_heads = 4, args.n_kv_heads = 2, args.n_layers = 4, args.vocab_size = 96;
  return args;
}

const AcPolicy kPolicies[] = {{AcMode::none, 1}, {AcMode::selective_op, 1}, {AcMode::selective_layer, 2}, {AcMode::full, 1}};

}  // namespace

// Zero-bubble schedules run a block's backward as an input-gradient pass and,
// later, a weight-gradient pass: together they must be the fused backward, bit
// for bit, and the first must leave the weight gradients untouched.
TEST(TransformerBlock, InputThenWeightGradientPassesEqualTheFusedBackward) {
  const ModelArgs args = small_llama();
  const int64_t B = 2, T = 24, layer = 1;
  for (DType dt : {DType::f32, DType::bf16}) {
    for (const AcPolicy& policy : kPolicies) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + ", AC " + ac_mode_name(policy.mode));
      ParamStore params(llama_param_specs(args), dt);
      params.init(5);
      const RopeTable rope = rope_table(T, args.head_dim(), args.rope_theta, args.rope_scaling);
      const ParallelStyle single_process;
      const int first = params.index_of("model.layers." + std::to_string(layer) + ".input_layernorm.weight");
      TransformerBlock block(params, first, layer, args, rope, single_process);
      const Tensor x = random_tensor({B * T, args.dim}, dt, "x");
      const Tensor dout = random_tensor({B * T, args.dim}, dt, "dout");
      auto fresh_dout = [&] {
        Tensor d = Tensor::empty(dout.shape(), dt, MemCategory::activations, "dout");
        d.copy_from(dout);
        return d;
      };

      params.zero_grad();
      BlockSaved saved;
      const Tensor out_fused = block.forward(x, B, T, policy, saved);
      const Tensor dx_fused = block.backward(saved, fresh_dout());
      const std::vector<double> grads_fused = to_double(params.grad_flat());

      params.zero_grad();
      const Tensor out_split = block.forward(x, B, T, policy, saved);
      WeightGradWork work;
      const Tensor dx_split = block.backward_input(saved, fresh_dout(), work);
      EXPECT_EQ(work.products.size(), 7u);  // the seven projections' weights
      for (const char* w : {"q_proj", "k_proj", "v_proj", "o_proj"}) {
        const Tensor g = params.grad(params.index_of("model.layers.1.self_attn." + std::string(w) + ".weight"));
        for (int64_t i = 0; i < g.numel(); ++i) ASSERT_EQ(g.data<float>()[i], 0.0f) << w << " before the weight pass";
      }
      block.backward_weight(work);
      EXPECT_TRUE(work.products.empty());

      EXPECT_TRUE(same_bytes(out_fused, out_split));
      EXPECT_TRUE(same_bytes(dx_fused, dx_split)) << "input gradients differ";
      const std::vector<double> grads_split = to_double(params.grad_flat());
      for (const ParamSpec& s : params.specs())
        for (int64_t i = s.offset; i < s.offset + s.numel(); ++i)
          ASSERT_EQ(grads_split[static_cast<size_t>(i)], grads_fused[static_cast<size_t>(i)]) << s.name << " [" << i - s.offset << "]";
      // And the block did learn something: some weight gradient is nonzero.
      double norm = 0;
      for (double g : grads_fused) norm += g * g;
      EXPECT_GT(norm, 0.0);
    }
  }
}

// A pipeline's two stages — the embedding and the first half of the blocks;
// the second half and the head — with the boundary activation handed forward
// and its gradient handed back, are the whole model: the same loss and the
// same gradients, bit for bit, under every checkpointing policy.
TEST(Llama, TwoStagesEqualTheWholeModel) {
  const ModelArgs args = small_llama();
  const int64_t B = 2, T = 16, n = args.n_layers, cut = 1 + n / 2;  // stage 0: modules [0, cut)
  Tensor tokens, targets;
  make_batch(B, T, args.vocab_size, tokens, targets);
  const float scale = 1.0f / 29.0f;
  for (DType dt : {DType::f32, DType::bf16}) {
    for (const AcPolicy& policy : kPolicies) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + ", AC " + ac_mode_name(policy.mode));
      Llama whole(args, dt, T);
      whole.params().init(9);
      Llama first(args, dt, T, {.stages = {{0, static_cast<int>(cut)}}});
      Llama last(args, dt, T, {.stages = {{static_cast<int>(cut), llama_num_modules(args)}}});
      first.params().init(9);
      last.params().init(9);
      EXPECT_TRUE(first.has_embedding() && !first.has_head() && !last.has_embedding() && last.has_head());
      EXPECT_EQ(first.params().specs().size() + last.params().specs().size(), whole.params().specs().size());
      // Two micro-batches, accumulated, as a step with gradient accumulation.
      for (int k = 0; k < 2; ++k) {
        const CrossEntropyResult want = whole.forward_backward(tokens, targets, scale, policy);
        StageSaved saved_first, saved_last;
        const Tensor boundary = first.forward(tokens, B, T, policy, saved_first);
        last.forward(boundary, B, T, policy, saved_last);
        Tensor d_boundary;
        const CrossEntropyResult got = last.backward_from_loss(saved_last, targets, scale, &d_boundary);
        EXPECT_EQ(d_boundary.shape(), boundary.shape());
        EXPECT_FALSE(first.backward(saved_first, d_boundary).defined());  // the first stage has no input gradient
        EXPECT_EQ(got.loss_sum, want.loss_sum);
        EXPECT_EQ(got.num_tokens, want.num_tokens);
      }
      for (const ParamSpec& s : whole.params().specs()) {
        const Llama& stage = s.group < cut ? first : last;
        const Tensor got = stage.params().grad(stage.params().index_of(s.name));
        EXPECT_TRUE(same_bytes(got, whole.params().grad(whole.params().index_of(s.name)))) << s.name;
      }
    }
  }
}

// Three stages on two ranks as a V-shaped pipeline places them — rank a holds
// the first and the last, rank b the middle one — run with the backward split
// into input-gradient passes and weight-gradient passes, the weight passes
// late and out of order (micro-batch 1's input pass before micro-batch 0's
// weight pass), are the whole model: the same loss and gradients, bit for bit.
TEST(Llama, StagesSpreadOverRanksWithSplitBackwardsEqualTheWholeModel) {
  const ModelArgs args = small_llama();
  const int64_t B = 2, T = 16;
  const int n = llama_num_modules(args), c1 = 2, c2 = n - 2;  // stages [0, c1), [c1, c2), [c2, n)
  ASSERT_LT(c1, c2);
  Tensor tokens, targets;
  make_batch(B, T, args.vocab_size, tokens, targets);
  const float scale = 1.0f / 29.0f;
  using Part = Llama::BackwardPart;
  for (const AcPolicy& policy : kPolicies) {
    SCOPED_TRACE(std::string("AC ") + ac_mode_name(policy.mode));
    Llama whole(args, DType::f32, T);
    whole.params().init(9);
    Llama a(args, DType::f32, T, {.stages = {{0, c1}, {c2, n}}});
    Llama b(args, DType::f32, T, {.stages = {{c1, c2}}});
    a.params().init(9);
    b.params().init(9);
    ASSERT_EQ(a.num_stages(), 2);
    EXPECT_TRUE(a.has_embedding() && a.has_head() && !b.has_embedding() && !b.has_head());
    EXPECT_EQ(a.group_of_module(c2), c1);  // a's groups: its modules in order
    StageSaved a0[2], bm[2], a1[2];
    double want = 0, got = 0;
    for (int k = 0; k < 2; ++k) {
      want += whole.forward_backward(tokens, targets, scale, policy).loss_sum;
      const Tensor h1 = a.forward(0, tokens, B, T, policy, a0[k]);
      const Tensor h2 = b.forward(0, h1, B, T, policy, bm[k]);
      a.forward(1, h2, B, T, policy, a1[k]);
      Tensor d2, d1;
      got += a.backward_from_loss(1, a1[k], targets, scale, &d2, Part::input).loss_sum;
      d1 = b.backward(0, bm[k], d2, Part::input);
      EXPECT_FALSE(a.backward(0, a0[k], d1, Part::input).defined());
      if (k == 1) {  // the weight passes of both micro-batches, late
        for (int j : {0, 1}) {
          b.backward_weight(0, bm[j]);
          a.backward_weight(1, a1[j]);
          a.backward_weight(0, a0[j]);
        }
      }
    }
    EXPECT_EQ(got, want);
    for (const ParamSpec& s : whole.params().specs()) {
      const Llama& rank = s.group < c1 || s.group >= c2 ? a : b;
      const Tensor g = rank.params().grad(rank.params().index_of(s.name));
      EXPECT_TRUE(same_bytes(g, whole.params().grad(whole.params().index_of(s.name)))) << s.name;
    }
  }
}

TEST(Llama, AStageOfATiedModelMustHoldBothEnds) {
  ModelArgs args = small_llama();
  args.tie_embeddings = true;
  try {
    Llama stage(args, DType::f32, 16, {.stages = {{0, 3}}});
    FAIL() << "a tied model was split";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ties the output head to the embedding"), std::string::npos) << e.what();
  }
}

namespace {

// The parameters a model holds: its tensors' elements, without the flat buffers' padding (ParamStore::numel).
int64_t held_params(const Llama& model) {
  int64_t n = 0;
  for (const ParamSpec& s : model.params().specs()) n += s.numel();
  return n;
}

}  // namespace

// A mixture of experts builds as pipeline stages and under the plain style
// context parallelism runs through (its layers sum their per-sequence
// statistics through the style's sequence layout), each holding the
// parameters its shapes give. qwen3/debugmodel_moe: dim 256, 6 layers, 8
// query heads of 64 over 4 KV heads, vocabulary 2048, 8 experts of width 128,
// untied. A block: q and o 256·512 each, k and v 256·256 each (393,216);
// two norms of 256 and the q/k norms of 64 (640); the router 8·256 (2,048);
// the experts 8 · 3 · 256·128 (786,432): 1,182,336. The embedding and the
// head 2048·256 = 524,288 each, the final norm 256. The stage [0, 3) holds
// the embedding and blocks 0 and 1: 524,288 + 2 · 1,182,336 = 2,888,960; the
// whole model 2 · 524,288 + 6 · 1,182,336 + 256 = 8,142,848.
TEST(Llama, AMixtureOfExpertsBuildsAsStagesAndUnderThePlainStyle) {
  ParallelStyle plain;
  const Llama under_style(model_flavor("qwen3", "debugmodel_moe"), DType::f32, 16,
                          LlamaOptions{.parallel_style = &plain});
  const Llama stage(model_flavor("qwen3", "debugmodel_moe"), DType::f32, 16, LlamaOptions{.stages = {{0, 3}}});
  EXPECT_EQ(held_params(stage), 2'888'960);
  EXPECT_EQ(held_params(under_style), 8'142'848);
  EXPECT_EQ(model_flavor("qwen3", "debugmodel_moe").num_params(), 8'142'848);
}

// FLOPs per token are torchtitan's (get_moe_model_nparams_and_flops; for a
// dense model get_dense_model_nparams_and_flops): 6 · (the parameters a
// token's forward uses, less the input embedding; the output projection
// counts) + 6 · L · H · (2 · head_dim) · T, that is 12 · L · H · Q · T, the
// causal mask not discounted. Every number below is from the published shapes.
TEST(Llama, FlopsPerTokenAreTorchtitansCountOfTheWorkATokenRuns) {
  // qwen3/30B-A3B (config.json): hidden 2048, 48 layers, 32 query heads of
  // 128 over 4 KV heads, vocabulary 151,936, 128 experts of width 768, 8 per
  // token, untied. A block runs q and o 2048·4096 each, k and v 2048·512 each
  // (18,874,368), two norms of 2048 and the q/k norms of 128 (4,352), the
  // router 128·2048 (262,144) and 8 of its experts, 8 · 3 · 2048·768
  // (37,748,736): 56,889,600. With the embedding and the head, 151,936·2048 =
  // 311,164,928 each, and the final norm 2048: 48 · 56,889,600 + 2 ·
  // 311,164,928 + 2048 = 3,353,032,704 active (the card's 3.3B activated).
  const ModelArgs moe = model_flavor("qwen3", "30B-A3B");
  EXPECT_EQ(moe.active_params(), 3'353'032'704);
  EXPECT_EQ(flops_per_token(moe, 4096), 6.0 * (3'353'032'704.0 - 311'164'928.0) + 12.0 * 48 * 32 * 128 * 4096);
  // qwen3/debugmodel_moe at T = 16: a block runs 393,216 + 640 + 2,048 and 2
  // of its 8 experts, 2 · 3 · 256·128 = 196,608 (592,512); 6 · 592,512 + 2 ·
  // 524,288 + 256 = 4,603,904 active.
  const ModelArgs debug = model_flavor("qwen3", "debugmodel_moe");
  EXPECT_EQ(debug.active_params(), 4'603'904);
  EXPECT_EQ(flops_per_token(debug, 16), 6.0 * (4'603'904.0 - 524'288.0) + 12.0 * 6 * 8 * 64 * 16);
  // A dense model runs all of it: llama3/8B, 8,030,261,248 parameters
  // (published), less its embedding 128,256·4096 = 525,336,576; 32 layers of
  // 32 heads of 128, at T = 8192.
  const ModelArgs dense = model_flavor("llama3", "8B");
  EXPECT_EQ(dense.num_params(), 8'030'261'248);
  EXPECT_EQ(flops_per_token(dense, 8192), 6.0 * (8'030'261'248.0 - 525'336'576.0) + 12.0 * 32 * 32 * 128 * 8192);
}
