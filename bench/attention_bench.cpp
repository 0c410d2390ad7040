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
#include "anvil/ops/document_mask.h"
#include "anvil/ops/matmul.h"
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

namespace {
using namespace anvil;

// Block-causal attention over documents of doc_len tokens (0: causal, no
// documents), forward and backward in bf16, B = 1, Hq = Hkv. Tiles: tile_q ×
// tile_k forward, tile_q × tile_k backward, doc_tile for sequences of short
// documents (0: the defaults). Time per call, and "kept": the share of the
// causal tiles' work the kernels do (attention_tile_count); compare the rows
// with doc 0 at the same T, H, D.
void BM_AttentionDocuments(benchmark::State& state) {
  const int64_t T = state.range(0), H = state.range(1), D = state.range(2), doc_len = state.range(3);
  AttentionTiles tiles;
  if (state.range(4) > 0) tiles = {state.range(4), state.range(5), state.range(4), state.range(5)};
  if (state.range(6) > 0) tiles.doc = state.range(6);
  const DType dt = DType::bf16;
  Tensor q = Tensor::zeros({1, T, H, D}, dt, MemCategory::activations, "q");
  Tensor k = Tensor::zeros({1, T, H, D}, dt, MemCategory::activations, "k");
  Tensor v = Tensor::zeros({1, T, H, D}, dt, MemCategory::activations, "v");
  Tensor out = Tensor::zeros({1, T, H, D}, dt, MemCategory::activations, "out");
  Tensor lse = Tensor::zeros({1, H, T}, DType::f32, MemCategory::activations, "lse");
  Tensor dq = Tensor::zeros({1, T, H, D}, dt, MemCategory::activations, "dq");
  Tensor dk = Tensor::zeros({1, T, H, D}, dt, MemCategory::activations, "dk");
  Tensor dv = Tensor::zeros({1, T, H, D}, dt, MemCategory::activations, "dv");
  AttentionWindow window;
  if (doc_len > 0) {
    Tensor tokens = Tensor::zeros({1, T}, DType::i32, MemCategory::activations, "tokens");
    for (int64_t p = doc_len / 2; p < T; p += doc_len) tokens.data<int32_t>()[p] = 1;  // off the tile grid
    window.documents = Tensor::empty({1, 2, T}, DType::i32, MemCategory::activations, "documents");
    fill_document_bounds(tokens, 1, window.documents);
  }
  auto run = [&] {
    attention_forward(q, k, v, out, lse, 0.0f, tiles, window);
    attention_backward(out, q, k, v, out, lse, dq, dk, dv, 0.0f, tiles, window);
  };
  bench::run_and_report(state, run, 3.5 * 4.0 * H * double(T) * T * D / 2, 0);
  state.counters["kept"] = attention_tile_count(1, T, T, tiles, window).kept();
}
BENCHMARK(BM_AttentionDocuments)
    ->ArgsProduct({{2048}, {16}, {16, 128}, {0, 256}, {0}, {0}, {0}})
    ->ArgsProduct({{2048}, {16}, {16, 128}, {256}, {0}, {0}, {64, 192, 256, 512}})
    ->ArgNames({"T", "H", "D", "doc", "tq", "tk", "doc_tile"})
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.3);
}  // namespace

namespace {
using namespace anvil;
// One attention tile product as the kernels call it (bf16 operands, f32 out,
// the caller's scratchpad, on one thread): M × N × K. Time per call, to weigh
// oneDNN's fixed cost per call against the product's work at small head dims.
void BM_TileProduct(benchmark::State& state) {
  const int64_t M = state.range(0), N = state.range(1), K = state.range(2);
  const bool trans_b = state.range(3) != 0;
  Tensor a = Tensor::zeros({M, K}, DType::bf16, MemCategory::activations, "a");
  Tensor b = Tensor::zeros({K, N}, DType::bf16, MemCategory::activations, "b");
  Tensor c = Tensor::zeros({M, N}, DType::f32, MemCategory::activations, "c");
  const GemmShape s{.M = M, .N = N, .K = K, .trans_b = trans_b, .ab = DType::bf16, .c = DType::f32};
  std::vector<char> sp(gemm_scratchpad_bytes(s) + 64);
  const int calls = 1000;
  auto run = [&] {
    for (int i = 0; i < calls; ++i) gemm(s, a.raw(), b.raw(), c.raw(), sp.data());
  };
  bench::run_and_report(state, run, calls * 2.0 * M * N * K, 0);
  state.counters["us_per_call"] = benchmark::Counter(calls * 1e-6, benchmark::Counter::kIsIterationInvariantRate |
                                                                       benchmark::Counter::kInvert);
}
BENCHMARK(BM_TileProduct)
    ->ArgsProduct({{128, 256}, {128, 256}, {16, 128}, {0, 1}})
    ->ArgNames({"M", "N", "K", "tb"})
    ->Unit(benchmark::kMillisecond);
}  // namespace
