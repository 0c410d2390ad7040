// The peak FLOP rate that MFU divides by must be a real ceiling on the machine
// the test runs on: a large matrix product through Anvil's own matmul may
// approach it but never exceed it. (The old peak, the fp32 FMA rate at the
// clock /proc/cpuinfo shows, was beaten 2.4x by oneDNN's AVX512-BF16 kernels.)
// The rates compared are measured in the same process, seconds apart, so the
// host's drift cancels; nothing here asserts on time itself.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <vector>

#include "anvil/core/cpu_peak.h"
#include "anvil/core/parallel_for.h"
#include "anvil/ops/matmul.h"

namespace anvil {
namespace {

// Best of `reps` timed N x N x N products in `dt` (bf16 inputs round-trip
// through fp32 storage here only for the fill; the product itself is bf16).
double gemm_flops_per_s(DType dt, int64_t n, int reps) {
  const size_t elems = static_cast<size_t>(n * n);
  std::vector<float> a32(elems), b32(elems), c(elems);
  for (size_t i = 0; i < elems; ++i) a32[i] = static_cast<float>(i % 7) * 0.01f, b32[i] = static_cast<float>(i % 5) * 0.01f;
  std::vector<uint16_t> a16(elems), b16(elems);
  for (size_t i = 0; i < elems; ++i) a16[i] = bf16::from_float(a32[i]), b16[i] = bf16::from_float(b32[i]);
  const void* A = dt == DType::bf16 ? static_cast<const void*>(a16.data()) : a32.data();
  const void* B = dt == DType::bf16 ? static_cast<const void*>(b16.data()) : b32.data();
  GemmShape s;
  s.M = s.N = s.K = n;
  s.ab = dt;
  s.c = DType::f32;
  gemm(s, A, B, c.data());  // creates (JIT-compiles) the primitive, outside the timing
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    gemm(s, A, B, c.data());
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  EXPECT_TRUE(std::isfinite(c[elems - 1]));
  return 2.0 * static_cast<double>(n) * n * n / best;
}

void expect_gemm_within_peak(DType dt) {
  const PeakFlops peak = cpu_peak_flops(dt, num_threads());
  const double rate = gemm_flops_per_s(dt, 2048, 6);
  const double ratio = rate / peak.flops_per_s;
  std::printf("%s: 2048^3 GEMM (%s) %.3f TFLOP/s; peak %s; GEMM/peak = %.3f\n", dtype_name(dt),
              matmul_impl_name(dt).c_str(), rate / 1e12, peak.derivation.c_str(), ratio);
  EXPECT_LE(ratio, 1.0) << "a matrix product ran faster than the peak MFU divides by: " << peak.derivation;
  // A peak 20x above what the best kernel reaches would make MFU meaningless too.
  EXPECT_GT(ratio, 0.05) << peak.derivation;
}

TEST(CpuPeak, Bf16GemmNeverBeatsTheReportedPeak) { expect_gemm_within_peak(DType::bf16); }
TEST(CpuPeak, Fp32GemmNeverBeatsTheReportedPeak) { expect_gemm_within_peak(DType::f32); }

TEST(CpuPeak, MeasurementsArePlausibleAndShown) {
  const CpuMeasurements& m = cpu_measurements();
  const CpuFeatures& f = cpu_features();
  std::printf("%s", cpu_peak_report(num_threads()).c_str());
  // Every x86 core of the last 20 years runs between 0.5 and 7 GHz.
  EXPECT_GT(m.clock_hz, 0.5e9);
  EXPECT_LT(m.clock_hz, 7e9);
  if (f.fma) {
    // One or two vector FMA pipes (or half of one, for a split 512-bit op).
    EXPECT_GT(m.fma_per_cycle, 0.35);
    EXPECT_LT(m.fma_per_cycle, 2.6);
  }
  // bf16 never peaks below fp32: a bf16 product can always be widened to fp32.
  EXPECT_GE(cpu_peak_flops(DType::bf16, 1).flops_per_s, cpu_peak_flops(DType::f32, 1).flops_per_s);
  // The derivation names every factor.
  const std::string d = cpu_peak_flops(DType::bf16, 2).derivation;
  EXPECT_NE(d.find("2 cores"), std::string::npos) << d;
  EXPECT_NE(d.find("GHz (measured)"), std::string::npos) << d;
  EXPECT_NE(d.find("TFLOP/s"), std::string::npos) << d;
}

}  // namespace
}  // namespace anvil
