// AdamW step over 16M parameters (a mid-sized Llama layer group), with and
// without writing the bf16 compute copy in the same pass. Memory-bound: GB/s
// counts the bytes that must move once: read p, g, m, v and write p, m, v
// (7 × 4 bytes per parameter), plus 2 bytes per parameter for the bf16 copy.
#include "anvil/core/rng.h"
#include "anvil/ops/adamw.h"
#include "ceilings.h"

namespace {
using namespace anvil;
using anvil::bench::run_and_report;

Tensor random_f32(int64_t n, float lo, float hi, MemCategory cat, const char* name) {
  Tensor t = Tensor::empty({n}, DType::f32, cat, name);
  fill_uniform(t, {11, name}, lo, hi);
  return t;
}

void BM_AdamW(benchmark::State& state, bool bf16_copy) {
  const int64_t n = state.range(0);
  Tensor p = random_f32(n, -0.1f, 0.1f, MemCategory::parameters, "p");
  Tensor g = random_f32(n, -1e-3f, 1e-3f, MemCategory::gradients, "g");
  Tensor m = random_f32(n, -1e-4f, 1e-4f, MemCategory::optimizer_state, "m");
  Tensor v = random_f32(n, 0.0f, 1e-6f, MemCategory::optimizer_state, "v");
  Tensor pb = Tensor::empty({n}, DType::bf16, MemCategory::parameters, "p_bf16");
  // A tiny lr keeps the parameters from drifting over thousands of steps.
  const AdamWConfig cfg{.lr = 1e-8f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f};
  int64_t step = 0;
  const double bytes = static_cast<double>(n) * (7 * 4 + (bf16_copy ? 2 : 0));
  run_and_report(state, [&] { adamw_step(cfg, ++step, p, g, m, v, bf16_copy ? &pb : nullptr, 0.5f); }, 0, bytes);
}

BENCHMARK_CAPTURE(BM_AdamW, f32, false)->Arg(int64_t{16} << 20)->ArgName("n")->Unit(benchmark::kMillisecond)->MinTime(0.3);
BENCHMARK_CAPTURE(BM_AdamW, with_bf16_copy, true)
    ->Arg(int64_t{16} << 20)
    ->ArgName("n")
    ->Unit(benchmark::kMillisecond)
    ->MinTime(0.3);
}  // namespace
