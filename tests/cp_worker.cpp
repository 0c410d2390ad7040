// The multi-rank half of context_parallel_test: a GoogleTest program with its
// own main (it starts MPI), run under mpirun with 2 and 4 ranks, all of them
// one context-parallel group. Every rank makes the same whole sequences (q, k,
// v, dout of B sequences of T tokens, from one seed), computes the whole
// sequences' attention with the single-process kernel, then runs its own
// chunks through ContextParallel (keys and values gathered over the group, the
// keys' gradients reduce-scattered back) and compares its rows with the
// reference's: out, lse and dq of its queries, dk and dv of its keys. Both
// load balancers, both rotate methods, GQA (4 query heads over 2 KV heads), B = 2;
// causal, and block-causal over documents that span chunks and ranks (some
// of a rank's queries then see none of another rank's keys).
//
// Tolerance (fp32): the chunks' attention sums the same products as the whole
// sequence's, in other tiles, and the keys' gradients add the ranks' parts in
// another order: a few ulps, measured below 1e-6; 1e-5 relative in norm (lse:
// absolute) still catches a chunk at the wrong position (RoPE, mask) or a
// gradient sent to the wrong rank by orders of magnitude.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "anvil/distributed/comm.h"
#include "anvil/distributed/context_parallel.h"
#include "anvil/ops/attention.h"
#include "anvil/ops/document_mask.h"
#include "anvil/ops/rope.h"
#include "mpi_test_util.h"
#include "test_util.h"

using namespace anvil;

namespace {

Communicator* g_world = nullptr;

// Local rows (2B, c, H, D) of whole sequences x (B, T, H, D): this rank's chunks.
Tensor local_rows(const ContextParallel& cp, const Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), D = x.size(3), c = T / (2 * cp.degree());
  Tensor out = Tensor::empty({2 * B, c, H, D}, x.dtype(), MemCategory::workspace, "local");
  const Tensor flat_x = x.view({x.numel()});
  Tensor flat_out = out.view({out.numel()});
  for (int j = 0; j < 2; ++j)
    for (int64_t b = 0; b < B; ++b)
      flat_out.slice((j * B + b) * c * H * D, c * H * D)
          .copy_from(flat_x.slice((b * T + cp.chunk(j) * c) * H * D, c * H * D));
  return out;
}

// The same for lse (B, H, T) → (2B, H, c).
Tensor local_lse(const ContextParallel& cp, const Tensor& lse) {
  const int64_t B = lse.size(0), H = lse.size(1), T = lse.size(2), c = T / (2 * cp.degree());
  Tensor out = Tensor::empty({2 * B, H, c}, DType::f32, MemCategory::workspace, "local_lse");
  for (int j = 0; j < 2; ++j)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t t = 0; t < c; ++t)
          out.data<float>()[((j * B + b) * H + h) * c + t] = lse.data<float>()[(b * H + h) * T + cp.chunk(j) * c + t];
  return out;
}

void expect_chunks_match_whole_sequences(CpLoadBalancer balancer, CpRotateMethod rotate, bool with_documents) {
  Communicator& group = *g_world;
  const ContextParallel cp(group, balancer, rotate);
  const int64_t B = 2, T = 16 * cp.degree(), Hq = 4, Hkv = 2, D = 16;
  // Documents: sequence 0 of lengths 5, 19, 3, then the rest; sequence 1 of
  // T/2 + 3 and the rest (chunks are 8 tokens).
  Tensor documents;
  if (with_documents) {
    Tensor tokens = Tensor::zeros({B, T}, DType::i32, MemCategory::workspace, "tokens");
    for (const int64_t last : {int64_t{4}, int64_t{23}, int64_t{26}, T + T / 2 + 2}) tokens.data<int32_t>()[last] = 1;
    documents = Tensor::empty({B, 2, T}, DType::i32, MemCategory::workspace, "documents");
    fill_document_bounds(tokens, 1, documents);
  }
  const AttentionWindow whole{0, 0, documents};
  // Whole sequences, the same on every rank; RoPE applied as the model does.
  const RopeTable rope = rope_table(T, D, 10000.0);
  Tensor q = anvil::testing::random_tensor({B, T, Hq, D}, DType::f32, "q", 2.0f);
  Tensor k = anvil::testing::random_tensor({B, T, Hkv, D}, DType::f32, "k", 2.0f);
  const Tensor v = anvil::testing::random_tensor({B, T, Hkv, D}, DType::f32, "v");
  const Tensor dout = anvil::testing::random_tensor({B, T, Hq, D}, DType::f32, "dout");
  Tensor q_local = local_rows(cp, q), k_local = local_rows(cp, k);
  rope_forward(q, rope, 0, q);
  rope_forward(k, rope, 0, k);
  Tensor out = Tensor::empty(q.shape(), DType::f32, MemCategory::workspace, "out");
  Tensor lse = Tensor::empty({B, Hq, T}, DType::f32, MemCategory::workspace, "lse");
  attention_forward(q, k, v, out, lse, 0.0f, {}, whole);
  Tensor dq = Tensor::empty(q.shape(), DType::f32, MemCategory::workspace, "dq");
  Tensor dk = Tensor::empty(k.shape(), DType::f32, MemCategory::workspace, "dk");
  Tensor dv = Tensor::empty(v.shape(), DType::f32, MemCategory::workspace, "dv");
  attention_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0f, {}, whole);

  // This rank's chunks through ContextParallel: RoPE at the chunks' positions, then attention.
  cp.rope_forward(q_local, rope, q_local);
  cp.rope_forward(k_local, rope, k_local);
  EXPECT_LT(anvil::testing::rel_error(q_local, anvil::testing::to_double(local_rows(cp, q))), 1e-6) << "RoPE of q";
  const Tensor v_local = local_rows(cp, v), dout_local = local_rows(cp, dout);
  Tensor out_l = Tensor::empty(q_local.shape(), DType::f32, MemCategory::workspace, "out_l");
  Tensor lse_l = Tensor::empty({2 * B, Hq, q_local.size(1)}, DType::f32, MemCategory::workspace, "lse_l");
  cp.attention_forward(q_local, k_local, v_local, out_l, lse_l, documents);
  Tensor dq_l = Tensor::empty(q_local.shape(), DType::f32, MemCategory::workspace, "dq_l");
  Tensor dk_l = Tensor::empty(k_local.shape(), DType::f32, MemCategory::workspace, "dk_l");
  Tensor dv_l = Tensor::empty(v_local.shape(), DType::f32, MemCategory::workspace, "dv_l");
  cp.attention_backward(dout_local, q_local, k_local, v_local, out_l, lse_l, dq_l, dk_l, dv_l, documents);
  // The keys' gradients after RoPE's backward, as the model takes them.
  Tensor dk_whole = dk, dk_local = dk_l;
  rope_backward(dk, rope, 0, dk_whole);
  cp.rope_backward(dk_l, rope, dk_local);

  const double e_out = anvil::testing::rel_error(out_l, anvil::testing::to_double(local_rows(cp, out)));
  const double e_lse =
      anvil::testing::max_abs_error(anvil::testing::to_double(lse_l), anvil::testing::to_double(local_lse(cp, lse)));
  const double e_dq = anvil::testing::rel_error(dq_l, anvil::testing::to_double(local_rows(cp, dq)));
  const double e_dk = anvil::testing::rel_error(dk_local, anvil::testing::to_double(local_rows(cp, dk_whole)));
  const double e_dv = anvil::testing::rel_error(dv_l, anvil::testing::to_double(local_rows(cp, dv)));
  std::printf("cp %d rank %d %-9s %-8s %-9s chunks %lld, %lld: out %.2e lse(abs) %.2e dq %.2e dk %.2e dv %.2e\n",
              cp.degree(), cp.rank(), cp_rotate_method_name(rotate), cp_load_balancer_name(balancer),
              with_documents ? "documents" : "causal",
              static_cast<long long>(cp.chunk(0)), static_cast<long long>(cp.chunk(1)), e_out, e_lse, e_dq, e_dk, e_dv);
  EXPECT_LT(e_out, 1e-5);
  EXPECT_LT(e_lse, 1e-5);
  EXPECT_LT(e_dq, 1e-5);
  EXPECT_LT(e_dk, 1e-5);
  EXPECT_LT(e_dv, 1e-5);
}

TEST(ContextParallel, HeadTailChunksMatchTheWholeSequences) {
  expect_chunks_match_whole_sequences(CpLoadBalancer::headtail, CpRotateMethod::allgather, false);
}
TEST(ContextParallel, ContiguousChunksMatchTheWholeSequences) {
  expect_chunks_match_whole_sequences(CpLoadBalancer::none, CpRotateMethod::allgather, false);
}
// The ring: the same rows from blocks passed rank to rank, merged by their lse.
TEST(ContextParallel, HeadTailChunksOverARingMatchTheWholeSequences) {
  expect_chunks_match_whole_sequences(CpLoadBalancer::headtail, CpRotateMethod::ring, false);
}
TEST(ContextParallel, ContiguousChunksOverARingMatchTheWholeSequences) {
  expect_chunks_match_whole_sequences(CpLoadBalancer::none, CpRotateMethod::ring, false);
}
// Block-causal: documents spanning chunks attend across ranks, both ways.
TEST(ContextParallel, DocumentChunksMatchTheWholeSequences) {
  for (const CpLoadBalancer b : {CpLoadBalancer::headtail, CpLoadBalancer::none})
    for (const CpRotateMethod r : {CpRotateMethod::allgather, CpRotateMethod::ring})
      expect_chunks_match_whole_sequences(b, r, true);
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
