// The experts' grouped products (ops/moe_experts.h) against one dense product
// of the same rows and FLOPs, in bf16: forward, input gradient and weight
// gradient of one R × K → N linear layer, R = tokens · top_k routed rows over
// E experts. "balanced": R / E rows each; "skewed": half the rows on one
// expert, the rest spread evenly. The dense row is linear_forward,
// linear_backward_input and linear_backward_weight on all R rows with one
// weight. TFLOP/s counts 3 · 2·R·N·K for both.
#include "anvil/ops/matmul.h"
#include "anvil/ops/moe_experts.h"
#include "ceilings.h"

namespace {
using namespace anvil;

void BM_MoeGroupedLinear(benchmark::State& state) {
  const int64_t R = state.range(0), K = state.range(1), N = state.range(2), E = state.range(3);
  const bool skewed = state.range(4) != 0;
  std::vector<int64_t> offsets{0};
  for (int64_t e = 0; e < E; ++e) {
    const int64_t rows = skewed ? (e == 0 ? R / 2 + (R / 2) % (E - 1) : R / 2 / (E - 1)) : R / E + (e < R % E);
    offsets.push_back(offsets.back() + rows);
  }
  Tensor x = Tensor::zeros({R, K}, DType::bf16, MemCategory::activations, "x");
  Tensor w = Tensor::zeros({E, N, K}, DType::bf16, MemCategory::parameters, "w");
  Tensor y = Tensor::zeros({R, N}, DType::bf16, MemCategory::activations, "y");
  Tensor dx = Tensor::zeros({R, K}, DType::bf16, MemCategory::activations, "dx");
  Tensor dw = Tensor::zeros({E, N, K}, DType::f32, MemCategory::gradients, "dw");
  auto run = [&] {
    grouped_linear_forward(x, w, offsets, y);
    grouped_linear_backward_input(y, w, offsets, dx);
    grouped_linear_backward_weight(y, x, offsets, dw);
  };
  bench::run_and_report(state, run, 3 * 2.0 * R * N * K, 0);
}
BENCHMARK(BM_MoeGroupedLinear)
    ->Args({8192, 512, 256, 16, 0})
    ->Args({8192, 512, 256, 16, 1})
    ->Args({8192, 512, 128, 128, 0})
    ->ArgNames({"R", "K", "N", "E", "skewed"})
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.5);

void BM_MoeDenseLinear(benchmark::State& state) {
  const int64_t R = state.range(0), K = state.range(1), N = state.range(2);
  Tensor x = Tensor::zeros({R, K}, DType::bf16, MemCategory::activations, "x");
  Tensor w = Tensor::zeros({N, K}, DType::bf16, MemCategory::parameters, "w");
  Tensor y = Tensor::zeros({R, N}, DType::bf16, MemCategory::activations, "y");
  Tensor dx = Tensor::zeros({R, K}, DType::bf16, MemCategory::activations, "dx");
  Tensor dw = Tensor::zeros({N, K}, DType::f32, MemCategory::gradients, "dw");
  auto run = [&] {
    linear_forward(x, w, y);
    linear_backward_input(y, w, dx);
    linear_backward_weight(y, x, dw);
  };
  bench::run_and_report(state, run, 3 * 2.0 * R * N * K, 0);
}
BENCHMARK(BM_MoeDenseLinear)
    ->Args({8192, 512, 256})
    ->Args({8192, 512, 128})
    ->ArgNames({"R", "K", "N"})
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.5);
}  // namespace
