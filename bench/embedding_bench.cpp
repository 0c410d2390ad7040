// Embedding gather (forward) and scatter-add (backward) at V = 32000, D = 2048,
// M = 4096..16384 tokens drawn uniformly (so some repeat). GB/s counts token
// ids read, and per token one table row read + one output row written
// (forward), or one dout row read + one dtable row read and written (backward).
#include "anvil/ops/embedding.h"
#include "ceilings.h"

namespace {
using namespace anvil;
using anvil::bench::run_and_report;

enum class Pass { forward, backward };

Tensor tokens_of(int64_t M, int64_t V) {
  Tensor t = Tensor::empty({M}, DType::i32, MemCategory::activations, "tokens");
  uint32_t s = 12345;
  for (int64_t i = 0; i < M; ++i) {
    s = s * 1664525u + 1013904223u;
    t.data<int32_t>()[i] = static_cast<int32_t>((s >> 8) % static_cast<uint32_t>(V));
  }
  return t;
}

// forward: table `a` -> out `b`; backward: dout `a` -> dtable `b`.
void BM_Embedding(benchmark::State& state, DType a, DType b, Pass pass) {
  const int64_t M = state.range(0), V = 32000, D = 2048;
  const double sa = static_cast<double>(dtype_size(a)), sb = static_cast<double>(dtype_size(b));
  const Tensor tokens = tokens_of(M, V);
  if (pass == Pass::forward) {
    Tensor table = Tensor::zeros({V, D}, a, MemCategory::parameters, "tok_embeddings");
    Tensor out = Tensor::zeros({M, D}, b, MemCategory::activations, "h");
    run_and_report(state, [&] { embedding_forward(tokens, table, out); }, 0, 4.0 * M + M * D * (sa + sb));
  } else {
    Tensor dout = Tensor::zeros({M, D}, a, MemCategory::activations, "dh");
    Tensor dtable = Tensor::zeros({V, D}, b, MemCategory::gradients, "tok_embeddings.grad");
    run_and_report(state, [&] { embedding_backward(dout, tokens, dtable); }, 0, 4.0 * M + M * D * (sa + 2 * sb));
  }
}

#define EMBEDDING_BENCH(name, a, b, pass)                                   \
  BENCHMARK_CAPTURE(BM_Embedding, name, DType::a, DType::b, Pass::pass)     \
      ->Arg(4096)                                                           \
      ->Arg(16384)                                                          \
      ->ArgName("M")                                                        \
      ->Unit(benchmark::kMillisecond)                                       \
      ->MinTime(0.3)
EMBEDDING_BENCH(forward_f32_table_to_bf16, f32, bf16, forward);
EMBEDDING_BENCH(forward_bf16_to_bf16, bf16, bf16, forward);
EMBEDDING_BENCH(forward_f32_to_f32, f32, f32, forward);
EMBEDDING_BENCH(backward_bf16_into_f32, bf16, f32, backward);
EMBEDDING_BENCH(backward_f32_into_f32, f32, f32, backward);
}  // namespace
