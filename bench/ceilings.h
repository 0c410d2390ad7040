// The two ceilings every kernel is judged against, measured in the same run:
// a large square bf16 GEMM through oneDNN (compute) and a large memory copy
// (bandwidth). The host's speed drifts by up to 3x between time windows, so
// each benchmark measures both right before and right after its own loop and
// reports its ratio to their mean: the two sides are interleaved.
#pragma once
#include <benchmark/benchmark.h>

#include <chrono>

namespace anvil::bench {

struct Ceilings {
  double gemm_bf16_tflops = 0;  // 2048³ bf16 GEMM, best of several
  double copy_gbps = 0;         // bytes read + bytes written per second, 128 MiB copy
};

Ceilings measure_ceilings();

// Times `run` under the benchmark loop, then sets counters for a kernel doing
// `flops` and moving `bytes` per call: TFLOP/s, GB/s and their ratios to the
// ceilings measured around the loop ("vs_gemm", "vs_copy").
template <class F>
void run_and_report(benchmark::State& state, F&& run, double flops, double bytes);

void report(benchmark::State& state, const Ceilings& before, double seconds, double flops, double bytes);

template <class F>
void run_and_report(benchmark::State& state, F&& run, double flops, double bytes) {
  run();  // warm-up: JIT, page faults
  const Ceilings before = measure_ceilings();
  const auto t0 = std::chrono::steady_clock::now();
  for (auto _ : state) run();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  report(state, before, secs, flops, bytes);
}

}  // namespace anvil::bench
