// SwiGLU forward and backward at the Llama FFN activation size M = 4096 tokens,
// F = 8192 hidden units. Element-wise and memory-bound: judged by GB/s against
// the copy bandwidth ("vs_copy"), counting the bytes that must move once:
// forward reads g, u and writes h; backward reads dh, g, u and writes dg, du.
#include "anvil/core/rng.h"
#include "anvil/ops/swiglu.h"
#include "ceilings.h"

namespace {
using namespace anvil;
using anvil::bench::run_and_report;

Tensor random_activation(Shape s, DType dtype, const char* name) {
  Tensor f = Tensor::empty(s, DType::f32, MemCategory::workspace, name);
  fill_uniform(f, {7, name}, -4.0f, 4.0f);
  return f.to(dtype, MemCategory::activations, name);
}

void BM_SwiGLU(benchmark::State& state, DType dtype, bool backward) {
  const int64_t M = 4096, F = state.range(0);
  Tensor g = random_activation({M, F}, dtype, "g");
  Tensor u = random_activation({M, F}, dtype, "u");
  Tensor dh = random_activation({M, F}, dtype, "dh");
  Tensor h = Tensor::empty({M, F}, dtype, MemCategory::activations, "h");
  Tensor dg = Tensor::empty({M, F}, dtype, MemCategory::activations, "dg");
  Tensor du = Tensor::empty({M, F}, dtype, MemCategory::activations, "du");
  const double tensor_bytes = static_cast<double>(g.nbytes());
  if (backward)
    run_and_report(state, [&] { swiglu_backward(dh, g, u, dg, du); }, 0, 5 * tensor_bytes);
  else
    run_and_report(state, [&] { swiglu_forward(g, u, h); }, 0, 3 * tensor_bytes);
}

#define SWIGLU_BENCH(dt, name, bwd)                            \
  BENCHMARK_CAPTURE(BM_SwiGLU, dt##_##name, DType::dt, bwd)    \
      ->Arg(8192)                                              \
      ->ArgName("F")                                           \
      ->Unit(benchmark::kMillisecond)                          \
      ->MinTime(0.3)
SWIGLU_BENCH(bf16, forward, false);
SWIGLU_BENCH(bf16, backward, true);
SWIGLU_BENCH(f32, forward, false);
SWIGLU_BENCH(f32, backward, true);
}  // namespace
