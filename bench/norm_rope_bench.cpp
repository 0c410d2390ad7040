// RMSNorm (D = 2048) and RoPE (H·D = 32·128) forward and backward at
// M = B·T = 4096..16384 rows, f32 and bf16. Memory-bound: judged by GB/s against
// a memory copy (vs_copy), counting the bytes that must move: inputs read once
// plus outputs written once.
#include "anvil/core/parallel_for.h"
#include "anvil/ops/rmsnorm.h"
#include "anvil/ops/rope.h"
#include "ceilings.h"

namespace {
using namespace anvil;
using anvil::bench::run_and_report;

enum class Pass { forward, backward };

// Cheap nonzero values (the kernels do not care which; zeros could hide work).
Tensor filled(Shape shape, DType dt, MemCategory cat, const char* tag) {
  Tensor f = Tensor::empty(shape, DType::f32, MemCategory::workspace, "bench.fill");
  float* p = f.data<float>();
  parallel_for(0, f.numel(), 1 << 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) p[i] = 0.25f + 0.01f * static_cast<float>(i % 97);
  });
  return dt == DType::f32 ? f : f.to(dt, cat, tag);
}

void BM_RMSNorm(benchmark::State& state, DType dt, Pass pass) {
  const int64_t M = state.range(0), D = 2048;
  const double s = static_cast<double>(dtype_size(dt));
  Tensor x = filled({M, D}, dt, MemCategory::activations, "x");
  Tensor w = filled({D}, dt, MemCategory::parameters, "w");
  Tensor y = Tensor::empty({M, D}, dt, MemCategory::activations, "y");
  Tensor rstd = Tensor::empty({M}, DType::f32, MemCategory::activations, "rstd");
  Tensor dw = Tensor::zeros({D}, DType::f32, MemCategory::gradients, "dw");  // f32 accumulator
  rmsnorm_forward(x, w, 1e-5f, y, rstd);
  if (pass == Pass::forward) {
    // x read, y written, w read, rstd written
    const double bytes = 2.0 * M * D * s + D * s + 4.0 * M;
    run_and_report(state, [&] { rmsnorm_forward(x, w, 1e-5f, y, rstd); }, 0, bytes);
  } else {
    Tensor& dy = y;  // any values do
    Tensor dx = Tensor::empty({M, D}, dt, MemCategory::activations, "dx");
    // x, dy read, dx written, w and rstd read, dw read and written
    const double bytes = 3.0 * M * D * s + D * s + 4.0 * M + 8.0 * D;
    run_and_report(state, [&] { rmsnorm_backward(dy, x, w, rstd, 1e-5f, dx, dw); }, 0, bytes);
  }
}

void BM_RoPE(benchmark::State& state, DType dt, Pass pass) {
  const int64_t M = state.range(0), T = 2048, B = M / T, H = 32, D = 128;
  const double s = static_cast<double>(dtype_size(dt));
  const RopeTable table = rope_table(T, D, 500000.0);
  Tensor x = filled({B, T, H, D}, dt, MemCategory::activations, "q");
  Tensor y = Tensor::empty({B, T, H, D}, dt, MemCategory::activations, "q_rot");
  // x read, y written, the cos/sin table (T, D/2) ×2 f32 read once
  const double bytes = 2.0 * M * H * D * s + 2.0 * T * (D / 2) * 4;
  if (pass == Pass::forward)
    run_and_report(state, [&] { rope_forward(x, table, 0, y); }, 0, bytes);
  else
    run_and_report(state, [&] { rope_backward(x, table, 0, y); }, 0, bytes);
}

#define NORM_ROPE_BENCH(fn, dt, pass)                                                      \
  BENCHMARK_CAPTURE(fn, dt##_##pass, DType::dt, Pass::pass)                               \
      ->Arg(4096)                                                                          \
      ->Arg(8192)                                                                          \
      ->Arg(16384)                                                                         \
      ->ArgName("M")                                                                       \
      ->Unit(benchmark::kMillisecond)                                                      \
      ->MinTime(0.3)
NORM_ROPE_BENCH(BM_RMSNorm, bf16, forward);
NORM_ROPE_BENCH(BM_RMSNorm, bf16, backward);
NORM_ROPE_BENCH(BM_RMSNorm, f32, forward);
NORM_ROPE_BENCH(BM_RMSNorm, f32, backward);
NORM_ROPE_BENCH(BM_RoPE, bf16, forward);
NORM_ROPE_BENCH(BM_RoPE, bf16, backward);
NORM_ROPE_BENCH(BM_RoPE, f32, forward);
NORM_ROPE_BENCH(BM_RoPE, f32, backward);
}  // namespace
