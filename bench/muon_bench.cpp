// Muon's Newton–Schulz (ops/muon.h) on the 125M model's matrix shapes: the
// attention projections (768 × 768; 256 × 768 for k and v, 4 KV heads of 64)
// and the feed-forward's (2048 × 768 and 768 × 2048), 5 iterations in bf16 (as
// PyTorch ships it) and in f32. FLOPs: 5·(4r²c + 2r³) for r = min, c = max of
// the shape (newton_schulz_flops); the report sets them against the GEMM
// ceiling measured in the same run.
#include "anvil/core/rng.h"
#include "anvil/ops/muon.h"
#include "ceilings.h"

namespace {
using namespace anvil;
using anvil::bench::run_and_report;

void BM_NewtonSchulz(benchmark::State& state, DType dtype) {
  const int64_t rows = state.range(0), cols = state.range(1);
  MuonConfig cfg;
  cfg.ns_dtype = dtype;
  Tensor u = Tensor::empty({rows, cols}, DType::f32, MemCategory::workspace, "u");
  fill_uniform(u, {13, "muon.bench.u"}, -1.0f, 1.0f);
  Tensor o = Tensor::empty({rows, cols}, DType::f32, MemCategory::workspace, "o");
  run_and_report(state, [&] { newton_schulz(cfg, u, o); }, newton_schulz_flops(cfg, rows, cols), 0);
}

#define NS_BENCH(dt)                                                                  \
  BENCHMARK_CAPTURE(BM_NewtonSchulz, dt, DType::dt)                                   \
      ->Args({768, 768})                                                              \
      ->Args({256, 768})                                                              \
      ->Args({2048, 768})                                                             \
      ->Args({768, 2048})                                                             \
      ->ArgNames({"rows", "cols"})                                                    \
      ->Unit(benchmark::kMillisecond)                                                 \
      ->MinTime(0.3)
NS_BENCH(bf16);
NS_BENCH(f32);
}  // namespace
