// The multi-rank half of tensor_parallel_test: a GoogleTest program with its
// own main (it starts MPI), run under mpirun with 2 and 4 ranks, all of them
// one tensor-parallel group. Each test builds a small Llama twice on every rank
// — whole (the single-process reference) and as this rank's tensor-parallel
// slice — from the same seed, runs the same micro-batches through both, and
// compares the tp model's weights, loss and gradients, assembled into global
// tensors over the group, with the reference's.
//
// The model is chosen to reach the corners the trainer-level tests cannot:
// grouped-query attention (8 query heads over 4 KV heads: 2 and 1 KV heads per
// rank), a vocabulary of 1001 that no tp degree divides (padded to 1002 and
// 1004; the last rank's shard is part padding), token ids at both ends of the
// vocabulary, ignored targets, tied embeddings, and two accumulated
// micro-batches (a norm gradient summed over tp must not re-sum the first
// micro-batch's).
//
// Tolerances (fp32): the tp model computes the same sums in another order
// (row-parallel partial products added across ranks, the log-sum-exp combined
// from shard maxima), a few ulps each; losses agree to 1e-6 relative and every
// gradient tensor to 1e-5 relative norm. A wrong slice, a missing reduction or
// a padded row in the softmax moves them by orders of magnitude more.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "anvil/distributed/comm.h"
#include "anvil/distributed/tensor_parallel.h"
#include "anvil/model/llama.h"
#include "anvil/ops/grad_norm.h"
#include "mpi_test_util.h"

using namespace anvil;

namespace {

Communicator* g_world = nullptr;

ModelArgs small_model(bool tied) {
  ModelArgs a;
  a.name = "llama3";
  a.flavor = "tp_worker";
  a.dim = 64, a.n_layers = 2, a.n_heads = 8, a.n_kv_heads = 4, a.vocab_size = 1001;
  a.multiple_of = 32;  // feed-forward 8·64/3 = 170 → 192, divisible by 2 and 4
  a.max_seq_len = 64;
  a.rope_theta = 10000;
  a.tie_embeddings = tied;
  return a;
}

constexpr int64_t kBatch = 2, kSeq = 16;

// Micro-batch k: ids spread over the vocabulary, its last id (1000, in the
// last rank's part-padded shard) and 0 included; a few targets ignored.
void make_batch(int k, Tensor& tokens, Tensor& targets) {
  tokens = Tensor::empty({kBatch, kSeq}, DType::i32, MemCategory::workspace, "tokens");
  targets = Tensor::empty({kBatch, kSeq}, DType::i32, MemCategory::workspace, "targets");
  int32_t* t = tokens.data<int32_t>();
  int32_t* y = targets.data<int32_t>();
  for (int64_t i = 0; i < kBatch * kSeq; ++i) {
    t[i] = static_cast<int32_t>((i * 379 + 11 + k * 97) % 1001);
    y[i] = static_cast<int32_t>((i * 613 + 5 + k * 31) % 1001);
  }
  t[3] = 1000, y[4] = 1000, t[5] = 0, y[6] = 0;
  y[7] = -100, y[kSeq + 2] = -100;  // ignored rows
}

double rel_diff(const Tensor& got, const Tensor& want) {
  double d = 0, n = 0;
  for (int64_t i = 0; i < want.numel(); ++i) {
    const double a = got.item_f32(i), b = want.item_f32(i);
    d += (a - b) * (a - b);
    n += b * b;
  }
  return n == 0 ? std::sqrt(d) : std::sqrt(d / n);
}

struct Case {
  bool sequence_parallel, loss_parallel, tied;
  AcMode ac;
  std::string name() const {
    return std::string("SP ") + (sequence_parallel ? "on" : "off") + ", loss parallel " +
           (loss_parallel ? "on" : "off") + (tied ? ", tied embeddings" : "") + ", AC " + ac_mode_name(ac);
  }
};

void check_case(const Case& c) {
  SCOPED_TRACE(c.name());
  Communicator& world = *g_world;
  const ModelArgs args = small_model(c.tied);
  const AcPolicy policy{c.ac, 1};
  Llama ref(args, DType::f32, args.max_seq_len);
  ref.params().init(7);
  const TensorParallelStyle tp(world, args,
                               {.sequence_parallel = c.sequence_parallel, .loss_parallel = c.loss_parallel});
  Llama model(args, DType::f32, args.max_seq_len, {.parallel_style = &tp});
  model.params().init(7);
  const auto& gspecs = ref.params().specs();
  const auto& lspecs = model.params().specs();

  // The slices initialise to exactly the global tensor's elements, and a
  // checkpoint's global tensors slice back to exactly this rank's.
  const Tensor w = gather_tp_global(world, lspecs, model.params().master_flat(), gspecs, ref.params().numel());
  for (const ParamSpec& s : gspecs) {
    const Tensor a = w.slice(s.offset, s.numel()), b = ref.params().master_flat().slice(s.offset, s.numel());
    EXPECT_EQ(std::memcmp(a.raw(), b.raw(), a.nbytes()), 0) << s.name << " is not the global tensor's slice";
  }
  Tensor sliced = Tensor::zeros({model.params().numel()}, DType::f32, MemCategory::workspace, "sliced");
  global_flat_to_local(gspecs, ref.params().master_flat(), lspecs, sliced);
  EXPECT_EQ(std::memcmp(sliced.raw(), model.params().master_flat().raw(), sliced.nbytes()), 0);

  // Two micro-batches accumulated, as a step with gradient accumulation.
  const int64_t tokens_in_step = 2 * kBatch * kSeq - 4;
  for (int k = 0; k < 2; ++k) {
    Tensor tokens, targets;
    make_batch(k, tokens, targets);
    const CrossEntropyResult want = ref.forward_backward(tokens, targets, 1.0f / tokens_in_step, policy);
    const CrossEntropyResult got = model.forward_backward(tokens, targets, 1.0f / tokens_in_step, policy);
    EXPECT_EQ(got.num_tokens, want.num_tokens);
    EXPECT_LE(std::abs(got.loss_sum - want.loss_sum) / want.loss_sum, 1e-6) << got.loss_sum << " vs " << want.loss_sum;
    const CrossEntropyResult eval_want = ref.forward(tokens, targets), eval_got = model.forward(tokens, targets);
    EXPECT_LE(std::abs(eval_got.loss_sum - eval_want.loss_sum) / eval_want.loss_sum, 1e-6);
  }
  const Tensor g = gather_tp_global(world, lspecs, model.params().grad_flat(), gspecs, ref.params().numel());
  double worst = 0;
  for (const ParamSpec& s : gspecs) {
    const double e = rel_diff(g.slice(s.offset, s.numel()), ref.params().grad_flat().slice(s.offset, s.numel()));
    worst = std::max(worst, e);
    EXPECT_LE(e, 1e-5) << s.name;
  }
  // The padding rows of the vocabulary shards never receive a gradient.
  for (const ParamSpec& s : lspecs) {
    if (s.slice.dim != 0 || s.slice.begin + s.shape[0] <= s.slice.global_extent) continue;
    const int64_t valid = std::max<int64_t>(0, s.slice.global_extent - s.slice.begin), D = s.shape[1];
    const Tensor pad = model.params().grad_flat().slice(s.offset + valid * D, (s.shape[0] - valid) * D);
    for (int64_t i = 0; i < pad.numel(); ++i) EXPECT_EQ(pad.data<float>()[i], 0.0f) << s.name << " padding";
  }
  // The gradient norm counts each global element once: sharded pieces on every
  // rank, replicated ones on rank 0.
  const std::vector<Tensor> pieces = grads_counted_once(model.params(), model.params().grad_flat(), tp.rank());
  Tensor sum = Tensor::empty({1}, DType::f32, MemCategory::workspace, "sum");
  sum.data<float>()[0] = static_cast<float>(grad_sum_of_squares(pieces));
  world.all_reduce(sum);
  const Tensor all[] = {ref.params().grad_flat()};
  const double want_sq = grad_sum_of_squares(all);
  EXPECT_LE(std::abs(sum.data<float>()[0] - want_sq) / want_sq, 1e-5);
  if (world.rank() == 0) std::printf("  %-58s worst gradient difference %.2e\n", c.name().c_str(), worst);
}

TEST(TensorParallelModel, MatchesTheWholeModel) {
  for (bool sp : {true, false})
    for (bool lp : {true, false})
      for (bool tied : {false, true}) check_case({sp, lp, tied, AcMode::none});
}

TEST(TensorParallelModel, MatchesTheWholeModelUnderActivationCheckpointing) {
  for (AcMode ac : {AcMode::selective_op, AcMode::full}) {
    check_case({true, true, false, ac});
    check_case({false, true, false, ac});
  }
}

}  // namespace

int main(int argc, char** argv) {
  MpiRuntime mpi(argc, argv);
  Communicator w = Communicator::world();
  g_world = &w;
  ::testing::InitGoogleTest(&argc, argv);
  anvil::testing::report_only_failures_unless_rank_0(w.rank());
  return RUN_ALL_TESTS();
}
