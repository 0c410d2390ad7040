#include "ceilings.h"

#include <algorithm>

#include "anvil/core/tensor.h"
#include "anvil/ops/matmul.h"

namespace anvil::bench {

namespace {
template <class F>
double seconds_of(F&& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

Ceilings measure_ceilings() {
  Ceilings c;
  {
    const int64_t n = 2048;
    static Tensor a = Tensor::zeros({n, n}, DType::bf16, MemCategory::workspace, "ceiling.a");
    static Tensor b = Tensor::zeros({n, n}, DType::bf16, MemCategory::workspace, "ceiling.b");
    static Tensor out = Tensor::zeros({n, n}, DType::bf16, MemCategory::workspace, "ceiling.c");
    GemmShape s{.M = n, .N = n, .K = n, .ab = DType::bf16, .c = DType::bf16};
    gemm(s, a.raw(), b.raw(), out.raw());
    double best = 1e30;
    for (int i = 0; i < 6; ++i) best = std::min(best, seconds_of([&] { gemm(s, a.raw(), b.raw(), out.raw()); }));
    c.gemm_bf16_tflops = 2.0 * n * n * n / best / 1e12;
  }
  {
    const int64_t bytes = int64_t{128} << 20;
    static Tensor src = Tensor::zeros({bytes / 4}, DType::f32, MemCategory::workspace, "ceiling.src");
    static Tensor dst = Tensor::zeros({bytes / 4}, DType::f32, MemCategory::workspace, "ceiling.dst");
    double best = 1e30;
    for (int i = 0; i < 4; ++i) best = std::min(best, seconds_of([&] { dst.copy_from(src); }));
    c.copy_gbps = 2.0 * static_cast<double>(bytes) / best / 1e9;
  }
  return c;
}

void report(benchmark::State& state, const Ceilings& before, double seconds, double flops, double bytes) {
  const double iters = static_cast<double>(state.iterations());
  const Ceilings after = measure_ceilings();
  Ceilings c;
  c.gemm_bf16_tflops = (before.gemm_bf16_tflops + after.gemm_bf16_tflops) / 2;
  c.copy_gbps = (before.copy_gbps + after.copy_gbps) / 2;
  if (flops > 0) {
    const double tflops = flops * iters / seconds / 1e12;
    state.counters["TFLOP/s"] = tflops;
    state.counters["vs_gemm"] = tflops / c.gemm_bf16_tflops;
  }
  if (bytes > 0) {
    const double gbps = bytes * iters / seconds / 1e9;
    state.counters["GB/s"] = gbps;
    state.counters["vs_copy"] = gbps / c.copy_gbps;
  }
  state.counters["gemm_ceiling"] = c.gemm_bf16_tflops;
  state.counters["copy_ceiling"] = c.copy_gbps;
}

}  // namespace anvil::bench
