// Fused LM head + cross-entropy at M = 4096 tokens: D = 512 / 2048, V = 2048 (debugmodel) / 32000.
// FLOPs per forward_backward call, the work done: 6·M·V·D (logits, dx, dw) when the op keeps the
// logits between its passes or V fits one chunk, else 8·M·V·D (a recompute of the logits too);
// per forward call 2·M·V·D.
#include <cmath>

#include "anvil/core/rng.h"
#include "anvil/ops/cross_entropy.h"
#include "ceilings.h"

namespace {
using namespace anvil;
using anvil::bench::run_and_report;

void BM_CrossEntropy(benchmark::State& state, DType dtype, bool backward) {
  const int64_t M = 4096, D = state.range(0), V = state.range(1);
  Tensor x = Tensor::empty({M, D}, dtype, MemCategory::activations, "x");
  Tensor w = Tensor::empty({V, D}, dtype, MemCategory::parameters, "w");
  {
    // Realistic logits (std ≈ 1) so the softmax is not degenerate.
    Tensor f = Tensor::empty({M, D}, DType::f32, MemCategory::workspace, "x_f32");
    fill_normal(f, {1, "x"}, 0.0f, 1.0f);
    x.copy_from(f);
    Tensor g = Tensor::empty({V, D}, DType::f32, MemCategory::workspace, "w_f32");
    fill_normal(g, {1, "w"}, 0.0f, 1.0f / std::sqrt(static_cast<float>(D)));
    w.copy_from(g);
  }
  Tensor targets = Tensor::empty({M}, DType::i32, MemCategory::activations, "targets");
  for (int64_t i = 0; i < M; ++i) targets.data<int32_t>()[i] = static_cast<int32_t>((i * 7919) % V);
  Tensor dx = Tensor::zeros({M, D}, dtype, MemCategory::activations, "dx");
  Tensor dw = Tensor::zeros({V, D}, DType::f32, MemCategory::gradients, "dw");  // f32 accumulator
  const float scale = 1.0f / static_cast<float>(M);
  auto run = [&] {
    if (backward)
      cross_entropy_forward_backward(x, w, targets, scale, dx, dw);
    else
      cross_entropy_forward(x, w, targets);
  };
  const CrossEntropyBlocking blocking = cross_entropy_blocking(M, V, backward);
  const bool recomputes = backward && !blocking.keep_logits && V > blocking.chunk;
  run_and_report(state, run, (backward ? (recomputes ? 8.0 : 6.0) : 2.0) * M * V * D, 0);
}

// Args: D, V; the op's default row block and vocabulary chunk.
#define XENT_BENCH(dt, bwd, name)                                                \
  BENCHMARK_CAPTURE(BM_CrossEntropy, dt##_##name, DType::dt, bwd)                \
      ->ArgsProduct({{512, 2048}, {2048, 32000}})                      \
      ->ArgNames({"D", "V"})                                   \
      ->Unit(benchmark::kMillisecond)                                            \
      ->MinTime(0.3)
XENT_BENCH(bf16, true, forward_backward);
XENT_BENCH(bf16, false, forward);
XENT_BENCH(f32, true, forward_backward);
XENT_BENCH(f32, false, forward);
}  // namespace
