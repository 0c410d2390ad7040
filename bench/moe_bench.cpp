// The experts' grouped products (ops/moe_experts.h) against one dense product
// of the same rows and FLOPs, in bf16: forward, input gradient and weight
// gradient of one R × K → N linear layer, R = tokens · top_k routed rows over
// E experts. "balanced": R / E rows each; "skewed": half the rows on one
// expert, the rest spread evenly. The dense row is linear_forward,
// linear_backward_input and linear_backward_weight on all R rows with one
// weight. TFLOP/s counts 3 · 2·R·N·K for both.
#include "anvil/core/rng.h"
#include "anvil/model/moe_feed_forward.h"
#include "anvil/ops/matmul.h"
#include "anvil/ops/moe_experts.h"
#include "anvil/ops/swiglu.h"
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

namespace {
using namespace anvil;

// The whole MoE feed-forward layer (model/moe_feed_forward.h), forward and
// backward in bf16, against a dense SwiGLU feed-forward of the same active
// FLOPs: M tokens, each through k experts of width F, against one FFN of
// width k·F. Routing is what the random router picks (near balanced). FLOPs:
// the experts' 3 products forward and 6 backward, 2·M·k·F·D each, the same
// for the dense FFN; the router's (E columns) is not counted.
void BM_MoeFeedForward(benchmark::State& state) {
  const int64_t M = state.range(0), D = state.range(1), F = state.range(2), E = state.range(3), k = state.range(4);
  const DType dt = DType::bf16;
  Tensor x = Tensor::empty({M, D}, dt, MemCategory::activations, "x");
  fill_uniform(x, {5, "moe_bench.x"}, -1.0f, 1.0f);
  MoeWeights w{Tensor::empty({E, D}, dt, MemCategory::parameters, "router"),
               Tensor::empty({E, F, D}, dt, MemCategory::parameters, "w1"),
               Tensor::empty({E, F, D}, dt, MemCategory::parameters, "w3"),
               Tensor::empty({E, D, F}, dt, MemCategory::parameters, "w2")};
  for (Tensor* t : {&w.router, &w.w1, &w.w3, &w.w2}) fill_uniform(*t, {6, "moe_bench.w"}, -0.05f, 0.05f);
  MoeWeights g{Tensor::zeros({E, D}, DType::f32, MemCategory::gradients, "g.router"),
               Tensor::zeros({E, F, D}, DType::f32, MemCategory::gradients, "g.w1"),
               Tensor::zeros({E, F, D}, DType::f32, MemCategory::gradients, "g.w3"),
               Tensor::zeros({E, D, F}, DType::f32, MemCategory::gradients, "g.w2")};
  Tensor dx = Tensor::empty({M, D}, dt, MemCategory::activations, "dx");
  const RouterConfig cfg{k, true};
  auto run = [&] {
    MoeSaved saved;
    const Tensor y = moe_forward(x, w, cfg, saved);
    moe_backward(y, x, w, cfg, 0.001f, saved, dx, g);
  };
  bench::run_and_report(state, run, 9 * 2.0 * M * k * F * D, 0);
}
BENCHMARK(BM_MoeFeedForward)
    ->Args({2048, 512, 256, 16, 4})
    ->Args({1024, 512, 128, 128, 8})
    ->ArgNames({"M", "D", "F", "E", "k"})
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.5);

void BM_DenseFeedForward(benchmark::State& state) {
  const int64_t M = state.range(0), D = state.range(1), F = state.range(2);
  const DType dt = DType::bf16;
  Tensor x = Tensor::zeros({M, D}, dt, MemCategory::activations, "x");
  Tensor w1 = Tensor::zeros({F, D}, dt, MemCategory::parameters, "w1"), w3 = w1.to(dt, MemCategory::parameters, "w3");
  Tensor w2 = Tensor::zeros({D, F}, dt, MemCategory::parameters, "w2");
  Tensor g1 = Tensor::zeros({F, D}, DType::f32, MemCategory::gradients, "g1"), g3 = g1.to(DType::f32, MemCategory::gradients, "g3");
  Tensor g2 = Tensor::zeros({D, F}, DType::f32, MemCategory::gradients, "g2");
  Tensor gate = Tensor::empty({M, F}, dt, MemCategory::activations, "g"), up = gate.to(dt, MemCategory::activations, "u");
  Tensor s = gate.to(dt, MemCategory::activations, "s"), ds = gate.to(dt, MemCategory::activations, "ds");
  Tensor y = Tensor::empty({M, D}, dt, MemCategory::activations, "y"), dx = y.to(dt, MemCategory::activations, "dx");
  auto run = [&] {
    linear_forward(x, w1, gate);
    linear_forward(x, w3, up);
    swiglu_forward(gate, up, s);
    linear_forward(s, w2, y);
    linear_backward_input(y, w2, ds);
    linear_backward_weight(y, s, g2);
    swiglu_backward(ds, gate, up, gate, up);
    linear_backward_input(gate, w1, dx);
    linear_backward_input(up, w3, dx, /*accumulate_dx=*/true);
    linear_backward_weight(gate, x, g1);
    linear_backward_weight(up, x, g3);
  };
  bench::run_and_report(state, run, 9 * 2.0 * M * F * D, 0);
}
BENCHMARK(BM_DenseFeedForward)
    ->Args({2048, 512, 1024})
    ->Args({1024, 512, 1024})
    ->ArgNames({"M", "D", "F"})
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.5);
}  // namespace
