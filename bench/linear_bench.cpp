// Linear layer: forward Y = X·Wᵀ and both backward products, at M = 4096 tokens.
#include "anvil/ops/matmul.h"
#include "ceilings.h"

namespace {
using namespace anvil;
using anvil::bench::run_and_report;

enum class Pass { forward, backward_input, backward_weight };

void BM_Linear(benchmark::State& state, DType dtype, Pass pass) {
  const int64_t M = 4096, K = state.range(0), N = state.range(1);
  Tensor x = Tensor::zeros({M, K}, dtype, MemCategory::activations, "x");
  Tensor w = Tensor::zeros({N, K}, dtype, MemCategory::parameters, "w");
  Tensor y = Tensor::zeros({M, N}, dtype, MemCategory::activations, "y");
  Tensor dw = Tensor::zeros({N, K}, DType::f32, MemCategory::gradients, "dw");  // f32 accumulator
  auto run = [&] {
    switch (pass) {
      case Pass::forward: linear_forward(x, w, y); break;
      case Pass::backward_input: linear_backward_input(y, w, x); break;
      case Pass::backward_weight: linear_backward_weight(y, x, dw); break;
    }
  };
  run_and_report(state, run, 2.0 * M * N * K, 0);
}

#define LINEAR_BENCH(dt, pass)                                                                          \
  BENCHMARK_CAPTURE(BM_Linear, dt##_##pass, DType::dt, Pass::pass)                                      \
      ->ArgsProduct({{512, 2048}, {512, 2048}})                                                          \
      ->ArgNames({"K", "N"})                                                                            \
      ->Unit(benchmark::kMillisecond)                                                                   \
      ->MinTime(0.3)
LINEAR_BENCH(bf16, forward);
LINEAR_BENCH(bf16, backward_input);
LINEAR_BENCH(bf16, backward_weight);
LINEAR_BENCH(f32, forward);
LINEAR_BENCH(f32, backward_input);
LINEAR_BENCH(f32, backward_weight);
}  // namespace
