// Causal grouped-query attention, forward and backward, at B = 1, D = 128.
//
// FLOPs are counted the way flash-attention papers do for causal attention:
// the forward does two products (Q·Kᵀ and P·V) of 2·T·T·D each per query
// head, halved by the causal mask: 4·B·Hq·T²·D / 2. The backward does five
// (Q·Kᵀ recomputed, dO·Vᵀ, Pᵀ·dO, dSᵀ·Q, dS·K): 2.5× the forward, and
// forward + backward 3.5×. Work wasted on the masked half of the diagonal
// blocks and the element-wise softmax are not counted, so vs_gemm is an
// honest "fraction of GEMM speed". Target: vs_gemm ≥ 0.4 in bf16 at T = 2048.
#include "anvil/ops/attention.h"
#include "ceilings.h"

namespace {
using namespace anvil;
using anvil::bench::run_and_report;

enum class Pass { forward, backward, fwd_bwd };

void BM_Attention(benchmark::State& state, DType dtype, Pass pass) {
  const int64_t B = 1, D = 128, T = state.range(0), Hq = state.range(1), Hkv = state.range(2);
  Tensor q = Tensor::zeros({B, T, Hq, D}, dtype, MemCategory::activations, "q");
  Tensor k = Tensor::zeros({B, T, Hkv, D}, dtype, MemCategory::activations, "k");
  Tensor v = Tensor::zeros({B, T, Hkv, D}, dtype, MemCategory::activations, "v");
  Tensor out = Tensor::zeros({B, T, Hq, D}, dtype, MemCategory::activations, "out");
  Tensor lse = Tensor::zeros({B, Hq, T}, DType::f32, MemCategory::activations, "lse");
  Tensor dout = Tensor::zeros({B, T, Hq, D}, dtype, MemCategory::activations, "dout");
  Tensor dq = Tensor::zeros({B, T, Hq, D}, dtype, MemCategory::activations, "dq");
  Tensor dk = Tensor::zeros({B, T, Hkv, D}, dtype, MemCategory::activations, "dk");
  Tensor dv = Tensor::zeros({B, T, Hkv, D}, dtype, MemCategory::activations, "dv");
  attention_forward(q, k, v, out, lse);  // the backward needs a real lse
  auto run = [&] {
    if (pass != Pass::backward) attention_forward(q, k, v, out, lse);
    if (pass != Pass::forward) attention_backward(dout, q, k, v, out, lse, dq, dk, dv);
  };
  const double fwd_flops = 4.0 * B * Hq * double(T) * T * D / 2;
  const double flops = pass == Pass::forward ? fwd_flops : pass == Pass::backward ? 2.5 * fwd_flops : 3.5 * fwd_flops;
  run_and_report(state, run, flops, 0);
}

#define ATTENTION_BENCH(dt, pass)                                     \
  BENCHMARK_CAPTURE(BM_Attention, dt##_##pass, DType::dt, Pass::pass) \
      ->Args({2048, 8, 8})                                            \
      ->Args({2048, 16, 4})                                           \
      ->Args({512, 8, 8})                                             \
      ->Args({512, 16, 4})                                            \
      ->ArgNames({"T", "Hq", "Hkv"})                                  \
      ->Unit(benchmark::kMillisecond)                                 \
      ->MinTime(0.3)
ATTENTION_BENCH(bf16, forward);
ATTENTION_BENCH(bf16, backward);
ATTENTION_BENCH(bf16, fwd_bwd);
ATTENTION_BENCH(f32, forward);
ATTENTION_BENCH(f32, backward);
ATTENTION_BENCH(f32, fwd_bwd);
}  // namespace
