// The CPU's peak FLOP rate, the denominator of MFU, derived from what this
// processor really executes rather than from a table or from /proc/cpuinfo.
//
// Under a hypervisor "cpu MHz" is often the base (or TSC) clock while the cores
// run turbo, and the bf16 rate of AVX512-BF16 (vdpbf16ps) is twice the fp32 FMA
// rate: a peak built from those two facts came out 2.4x too low on an AMD EPYC
// and printed MFU 151%. So the clock and the vector issue rate are measured here
// with register-only loops (no memory traffic, nothing to optimise away), and the
// peak is cores x FLOP/cycle x clock with every factor shown.
#pragma once
#include <string>

#include "anvil/core/dtype.h"

namespace anvil {

// What CPUID and the OS say this core can execute.
struct CpuFeatures {
  std::string model_name;  // CPUID brand string
  bool fma = false;          // AVX2 + FMA3 (ymm)
  bool avx512f = false;      // AVX-512 foundation, zmm state enabled by the OS
  bool avx512_bf16 = false;  // vdpbf16ps: bf16 pairs dot-accumulated into fp32
  bool amx_bf16 = false;     // AMX tiles with bf16, tile state enabled by the OS
};
const CpuFeatures& cpu_features();

// Measured on the calling thread, each the best of several short trials.
struct CpuMeasurements {
  double clock_hz = 0;           // a chain of dependent integer adds retires one per cycle
  double fma_per_cycle = 0;      // vfmadd231ps on the widest vectors (zmm, else ymm), independent
  double dpbf16_per_cycle = 0;   // vdpbf16ps zmm, independent (0 without AVX512-BF16)
  double tdpbf16_per_cycle = 0;  // AMX TDPBF16PS, independent, one thread alone (0 without AMX or its permission)
  double tdpbf16_per_cycle_all_threads = 0;  // ... per thread, every hardware thread running it at once
  double reported_clock_hz = 0;  // the highest "cpu MHz" in /proc/cpuinfo, for comparison
};
// Measured once per process (about 50 ms) and cached.
const CpuMeasurements& cpu_measurements();

struct PeakFlops {
  double flops_per_s = 0;
  std::string derivation;  // "2 cores x 128 FLOP/cycle (AVX512-BF16 ...) x 3.10 GHz (measured) = 0.79 TFLOP/s"
};
// The peak of `cores` cores for matrix products in `compute_dtype` (f32 or bf16).
PeakFlops cpu_peak_flops(DType compute_dtype, int cores);

// Whether a bf16 matrix product runs faster with its operands widened to fp32
// (exactly: every bf16 is an fp32) and fp32 FMAs than on the CPU's bf16
// instructions: true without AMX when vdpbf16ps is slower than two FMA pipes
// (measured issue rates, rounded to the architectural 0.5/1/2 per cycle, so the
// choice does not flip with the host's noise) or is missing. Both routes
// accumulate in fp32; the results differ only in summation order.
bool bf16_products_faster_widened();

// Multi-line description for `anvil info`: features, the measurements, and both peaks.
std::string cpu_peak_report(int cores);

}  // namespace anvil
