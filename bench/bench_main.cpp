// Runs every op benchmark in bench/*_bench.cpp. Each benchmark reports its
// ratio to a bf16 GEMM and a memory copy measured right after it (ceilings.h).
#include <cstdio>

#include "anvil/core/parallel_for.h"
#include "anvil/ops/matmul.h"
#include "ceilings.h"

int main(int argc, char** argv) {
  using namespace anvil::bench;
  std::printf("threads: %d   bf16 matmul kernel: %s\n", anvil::num_threads(),
              anvil::matmul_impl_name(anvil::DType::bf16).c_str());
  const Ceilings c = measure_ceilings();
  std::printf("ceilings at start: bf16 GEMM 2048^3 %.3f TFLOP/s, memory copy %.1f GB/s (read+write)\n",
              c.gemm_bf16_tflops, c.copy_gbps);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
