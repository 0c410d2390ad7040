#include "anvil/core/cpu_peak.h"

#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <thread>
#include <vector>

namespace anvil {

namespace {

struct Regs {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
};
Regs cpuid(unsigned leaf, unsigned subleaf = 0) {
  Regs r;
  __cpuid_count(leaf, subleaf, r.eax, r.ebx, r.ecx, r.edx);
  return r;
}
bool bit(unsigned v, int b) { return (v >> b) & 1u; }

// XCR0: which register states the OS saves on a context switch. A CPU feature
// the OS does not enable faults (AVX-512 needs bits 5-7, AMX bits 17-18).
uint64_t xcr0() {
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

CpuFeatures detect() {
  CpuFeatures f;
  char brand[49] = {};
  if (cpuid(0x80000000).eax >= 0x80000004) {
    for (unsigned i = 0; i < 3; ++i) {
      const Regs r = cpuid(0x80000002 + i);
      std::memcpy(brand + 16 * i + 0, &r.eax, 4);
      std::memcpy(brand + 16 * i + 4, &r.ebx, 4);
      std::memcpy(brand + 16 * i + 8, &r.ecx, 4);
      std::memcpy(brand + 16 * i + 12, &r.edx, 4);
    }
  }
  f.model_name = brand;
  f.model_name.erase(0, f.model_name.find_first_not_of(' '));
  const unsigned max_leaf = cpuid(0).eax;
  const Regs l1 = cpuid(1);
  if (!bit(l1.ecx, 27) || max_leaf < 7) return f;  // no OSXSAVE: no AVX state at all
  const uint64_t x = xcr0();
  const bool avx_state = (x & 0x6) == 0x6;
  const bool avx512_state = avx_state && (x & 0xe0) == 0xe0;
  const bool amx_state = (x & 0x60000) == 0x60000;
  const Regs l7 = cpuid(7, 0);
  const Regs l7s1 = cpuid(7, 1);
  f.fma = avx_state && bit(l1.ecx, 12) && bit(l7.ebx, 5);  // FMA3 and AVX2
  f.avx512f = avx512_state && bit(l7.ebx, 16);
  f.avx512_bf16 = f.avx512f && bit(l7s1.eax, 5);
  f.amx_bf16 = amx_state && bit(l7.edx, 22) && bit(l7.edx, 24);  // AMX-BF16 and AMX-TILE
  return f;
}

constexpr int kTrials = 15;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

#define ANVIL_REP10(x) x x x x x x x x x x
#define ANVIL_REP100(x) ANVIL_REP10(ANVIL_REP10(x))

// 100 dependent register-register adds per iteration: each waits for the one
// before, and an integer add has a latency of exactly one cycle on every x86
// core, so the loop retires 100 adds per cycle-count of 100. (Adds of an
// immediate are avoided: recent Intel cores can fold those at rename.)
double time_add_chain(uint64_t iters) {
  uint64_t acc = 0, one = 1;
  const auto t0 = std::chrono::steady_clock::now();
  __asm__ volatile(
      "1:\n\t" ANVIL_REP100("add %[one], %[acc]\n\t") "dec %[n]\n\t"
      "jnz 1b\n\t"
      : [acc] "+r"(acc), [n] "+r"(iters)
      : [one] "r"(one)
      : "cc");
  return seconds_since(t0);
}

// 14 independent accumulators (zmm0-13) fed from zeroed zmm14/zmm15: enough in
// flight to cover a 4-6 cycle latency on two pipes, values that never become
// denormal, and no memory operand. Registers 0-15 only, so it assembles and
// clobbers correctly without -mavx512f.
#define ANVIL_ACC(insn, reg, i) insn " %%" reg "15, %%" reg "14, %%" reg #i "\n\t"
#define ANVIL_VEC_LOOP(insn, reg)                                                                                 \
  __asm__ volatile("vxorps %%xmm14, %%xmm14, %%xmm14\n\t"                                                          \
                   "vxorps %%xmm15, %%xmm15, %%xmm15\n\t"                                                          \
                   "1:\n\t" ANVIL_ACC(insn, reg, 0) ANVIL_ACC(insn, reg, 1) ANVIL_ACC(insn, reg, 2)              \
                       ANVIL_ACC(insn, reg, 3) ANVIL_ACC(insn, reg, 4) ANVIL_ACC(insn, reg, 5) ANVIL_ACC(insn, reg, 6) \
                           ANVIL_ACC(insn, reg, 7) ANVIL_ACC(insn, reg, 8) ANVIL_ACC(insn, reg, 9)                 \
                               ANVIL_ACC(insn, reg, 10) ANVIL_ACC(insn, reg, 11) ANVIL_ACC(insn, reg, 12)          \
                                   ANVIL_ACC(insn, reg, 13) "dec %[n]\n\t"                                       \
                                                            "jnz 1b\n\t"                                          \
                                                            "vzeroupper\n\t"                                      \
                   : [n] "+r"(iters)                                                                               \
                   :                                                                                               \
                   : "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",         \
                     "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15")
constexpr int kVecPerIter = 14;

enum class VecLoop { fma_zmm, fma_ymm, dpbf16_zmm };

double time_vec_loop(VecLoop kind, uint64_t iters) {
  const auto t0 = std::chrono::steady_clock::now();
  switch (kind) {
    case VecLoop::fma_zmm: ANVIL_VEC_LOOP("vfmadd231ps", "zmm"); break;
    case VecLoop::fma_ymm: ANVIL_VEC_LOOP("vfmadd231ps", "ymm"); break;
    case VecLoop::dpbf16_zmm: ANVIL_VEC_LOOP("vdpbf16ps", "zmm"); break;
  }
  return seconds_since(t0);
}

// AMX: Linux hands out the tile data state (XFEATURE_XTILEDATA, 18) only to
// a process that asks for it (arch_prctl ARCH_REQ_XCOMP_PERM); without it the
// first tile instruction faults. oneDNN asks for its own kernels.
bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0;
  return ok;
}

// Palette 1: eight tiles of 16 rows x 64 bytes (16 x 32 bf16, or 16 x 16 fp32).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

// Six independent TDPBF16PS per iteration into tmm0-5 from zeroed tmm6 and
// tmm7: enough in flight to cover the instruction's latency (several times its
// issue interval), values that never become denormal, no memory operand.
// The mnemonics need only the assembler (binutils 2.36 or later), not -mamx-*.
double time_tile_loop(uint64_t iters) {
  const TileConfig cfg;
  __asm__ volatile("ldtilecfg %0\n\t" ::"m"(cfg));
  __asm__ volatile(
      "tilezero %%tmm0\n\ttilezero %%tmm1\n\ttilezero %%tmm2\n\ttilezero %%tmm3\n\t"
      "tilezero %%tmm4\n\ttilezero %%tmm5\n\ttilezero %%tmm6\n\ttilezero %%tmm7\n\t" ::
          : "memory");
  const auto t0 = std::chrono::steady_clock::now();
  __asm__ volatile(
      "1:\n\t"
      "tdpbf16ps %%tmm7, %%tmm6, %%tmm0\n\t"
      "tdpbf16ps %%tmm7, %%tmm6, %%tmm1\n\t"
      "tdpbf16ps %%tmm7, %%tmm6, %%tmm2\n\t"
      "tdpbf16ps %%tmm7, %%tmm6, %%tmm3\n\t"
      "tdpbf16ps %%tmm7, %%tmm6, %%tmm4\n\t"
      "tdpbf16ps %%tmm7, %%tmm6, %%tmm5\n\t"
      "dec %[n]\n\t"
      "jnz 1b\n\t"
      : [n] "+r"(iters)
      :
      : "cc");
  const double secs = seconds_since(t0);
  __asm__ volatile("tilerelease\n\t" ::: "memory");
  return secs;
}
constexpr int kTilePerIter = 6;

// TDPBF16PS per second on one core alone, and per hardware thread with every
// hardware thread of the machine running the loop at once (hyperthreads share
// a core's tile unit; a loaded chip may clock lower): best of several trials each.
std::pair<double, double> measure_tile_rates() {
  constexpr uint64_t kIters = 20000;  // about 2 M cycles a trial at Intel's rate
  const unsigned n = std::max(1u, std::thread::hardware_concurrency());
  std::barrier start(static_cast<std::ptrdiff_t>(n));
  // Every thread starts each trial together (trial 0 warms up), so the trials overlap.
  auto best_rate = [&](bool together) {
    double best = 0;
    for (int trial = 0; trial <= kTrials; ++trial) {
      if (together) start.arrive_and_wait();
      const double r = kTilePerIter * kIters / time_tile_loop(kIters);
      if (trial > 0) best = std::max(best, r);
    }
    return best;
  };
  const double alone = best_rate(false);
  std::vector<double> rates(n, 0);
  std::vector<std::thread> threads;
  for (unsigned i = 0; i < n; ++i) threads.emplace_back([&, i] { rates[i] = best_rate(true); });
  for (std::thread& t : threads) t.join();
  double all = 0;
  for (double r : rates) all += r;
  return {alone, all / n};
}

double reported_clock_hz() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  double mhz = 0;
  while (std::getline(cpuinfo, line))
    if (line.rfind("cpu MHz", 0) == 0) mhz = std::max(mhz, std::atof(line.c_str() + line.find(':') + 1));
  return mhz * 1e6;
}

double architectural_rate(double measured);

CpuMeasurements measure() {
  const CpuFeatures& f = cpu_features();
  CpuMeasurements m;
  m.reported_clock_hz = reported_clock_hz();
  // Interleaved trials, best of each: another process, an interrupt or the
  // hypervisor can only make a trial slower, never faster. About 1 ms each.
  constexpr uint64_t kAddIters = 30000, kVecIters = 100000;
  // Enough that ranks sharing a core (mpirun --oversubscribe) still get
  // trials that run undisturbed from start to end.
  const bool zmm = f.avx512f;
  double adds_per_s = 0, fma_per_s = 0, dp_per_s = 0;
  const auto batch = [&] {
    for (int trial = 0; trial <= kTrials; ++trial) {  // trial 0 warms up (vector units power up, clocks settle)
      const double a = 100.0 * kAddIters / time_add_chain(kAddIters);
      double fm = 0, dp = 0;
      if (f.fma) fm = kVecPerIter * kVecIters / time_vec_loop(zmm ? VecLoop::fma_zmm : VecLoop::fma_ymm, kVecIters);
      if (f.avx512_bf16) dp = kVecPerIter * kVecIters / time_vec_loop(VecLoop::dpbf16_zmm, kVecIters);
      if (trial == 0) continue;
      adds_per_s = std::max(adds_per_s, a), fma_per_s = std::max(fma_per_s, fm), dp_per_s = std::max(dp_per_s, dp);
    }
  };
  batch();
  // The bf16 issue rate decides whether bf16 products run widened, which
  // changes what a run allocates and its rounding, so a verdict of "slower
  // than fp32" must not come from a batch that a loaded machine disturbed
  // throughout (every rank of a job must reach the same verdict): it is
  // measured again, later, before it stands. A core that really issues
  // vdpbf16ps slowly pays these batches once per process.
  for (int again = 0; again < 4 && f.avx512_bf16 && f.fma; ++again) {
    const double fma_rate = architectural_rate(fma_per_s / adds_per_s) * (zmm ? 32.0 : 16.0);
    const double dp_rate = architectural_rate(dp_per_s / adds_per_s) * 64.0;
    if (dp_rate >= fma_rate) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    batch();
  }
  m.clock_hz = adds_per_s;
  m.fma_per_cycle = fma_per_s / m.clock_hz;
  m.dpbf16_per_cycle = dp_per_s / m.clock_hz;
  if (f.amx_bf16 && amx_permitted()) {
    const auto [alone, all] = measure_tile_rates();
    m.tdpbf16_per_cycle = alone / m.clock_hz;
    m.tdpbf16_per_cycle_all_threads = all / m.clock_hz;
  }
  return m;
}

// Issue rates are whole numbers of pipes (or halves, where a wide vector is
// split in two): the nearest power of two. A measured 1.8 is two pipes slowed
// by AVX-512's lower clock, not 1.8 pipes.
double architectural_rate(double measured) {
  if (measured <= 0) return 0;
  return std::exp2(std::round(std::log2(measured)));
}

std::string format(const char* fmt, auto... args) {
  char buf[512];
  std::snprintf(buf, sizeof buf, fmt, args...);
  return buf;
}

// FLOP per cycle per core of the fp32 vector FMAs, and where that comes from.
std::pair<double, std::string> fp32_flops_per_cycle() {
  const CpuFeatures& f = cpu_features();
  const CpuMeasurements& m = cpu_measurements();
  if (!f.fma) return {8.0, "SSE: one 4-lane multiply and one 4-lane add per cycle (not measured)"};
  const double rate = architectural_rate(m.fma_per_cycle);
  const double flop = f.avx512f ? 32.0 : 16.0;  // 16 or 8 fp32 lanes, a multiply and an add each
  return {rate * flop, format("%s: vfmadd231ps %s measured %.2f/cycle -> %g x %g FLOP", f.avx512f ? "AVX-512" : "AVX2",
                              f.avx512f ? "zmm" : "ymm", m.fma_per_cycle, rate, flop)};
}

// FLOP per cycle per core for products in `dt`, and the words for where it comes from.
std::pair<double, std::string> flops_per_cycle(DType dt) {
  const CpuFeatures& f = cpu_features();
  const CpuMeasurements& m = cpu_measurements();
  const auto fp32 = fp32_flops_per_cycle();
  if (dt != DType::bf16) return fp32;
  if (f.amx_bf16) {
    // TDPBF16PS multiplies a 16x32 by a 32x16 bf16 tile into 16x16 fp32:
    // 8192 multiply-adds, 16384 FLOP. Its issue rate is measured like the
    // vector instructions' (Intel's manual says one every 16 cycles), alone
    // on one core and on every hardware thread at once; the peak takes the
    // all-at-once rate per thread, since a run uses every thread.
    if (m.tdpbf16_per_cycle > 0) {
      const double alone = architectural_rate(m.tdpbf16_per_cycle);
      const double per_thread = std::min(alone, m.tdpbf16_per_cycle_all_threads);
      return {per_thread * 16384.0,
              format("AMX-BF16: TDPBF16PS measured %.4f/cycle alone -> %g, %.4f/cycle per thread with all %u "
                     "threads at once; %.4f x 16384 FLOP",
                     m.tdpbf16_per_cycle, alone, m.tdpbf16_per_cycle_all_threads,
                     std::max(1u, std::thread::hardware_concurrency()), per_thread)};
    }
    return {1024.0,
            "AMX-BF16: TDPBF16PS, 16384 FLOP every 16 cycles (Intel's figure, not measured: the kernel refused "
            "tile permission)"};
  }
  // A bf16 product can always run as fp32 FMAs once its inputs are widened, so
  // bf16's peak is the faster of the two routes. vdpbf16ps is not always the
  // faster: on some Intel cores it issues once every two cycles, half the
  // FLOP rate of two FMA pipes; on AMD's it issues like an FMA, twice the rate.
  if (f.avx512_bf16) {
    const double rate = architectural_rate(m.dpbf16_per_cycle);
    // vdpbf16ps zmm: 16 fp32 lanes, each adding two bf16 products = 64 FLOP.
    const double dp = rate * 64.0;
    const std::string dp_why =
        format("vdpbf16ps zmm measured %.2f/cycle -> %g x 64 FLOP = %g", m.dpbf16_per_cycle, rate, dp);
    if (dp >= fp32.first) return {dp, format("AVX512-BF16: %s; fp32 FMAs give %g", dp_why.c_str(), fp32.first)};
    return {fp32.first,
            format("bf16 widened to fp32 %s; AVX512-BF16's %s is slower here", fp32.second.c_str(), dp_why.c_str())};
  }
  return {fp32.first, "no bf16 arithmetic, bf16 runs as fp32; " + fp32.second};
}

}  // namespace

bool bf16_products_faster_widened() {
  const CpuFeatures& f = cpu_features();
  if (f.amx_bf16) return false;
  if (!f.avx512_bf16) return true;
  return architectural_rate(cpu_measurements().dpbf16_per_cycle) * 64.0 < fp32_flops_per_cycle().first;
}

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = detect();
  return f;
}

const CpuMeasurements& cpu_measurements() {
  static const CpuMeasurements m = measure();
  return m;
}

PeakFlops cpu_peak_flops(DType dt, int cores) {
  cores = std::max(1, std::min<int>(cores, static_cast<int>(std::max(1u, std::thread::hardware_concurrency()))));
  const auto [per_cycle, why] = flops_per_cycle(dt);
  const double clock = cpu_measurements().clock_hz;
  PeakFlops p;
  p.flops_per_s = cores * per_cycle * clock;
  p.derivation = format("%d cores x %g FLOP/cycle (%s) x %.2f GHz (measured) = %.3f TFLOP/s", cores, per_cycle,
                        why.c_str(), clock / 1e9, p.flops_per_s / 1e12);
  return p;
}

std::string cpu_peak_report(int cores) {
  const CpuFeatures& f = cpu_features();
  const CpuMeasurements& m = cpu_measurements();
  auto yes = [](bool b) { return b ? "yes" : "no"; };
  std::string s = format("cpu: %s\n", f.model_name.empty() ? "(no brand string)" : f.model_name.c_str());
  s += format("isa: AVX2+FMA %s, AVX-512 %s, AVX512-BF16 %s, AMX-BF16 %s (CPUID, with the OS's XCR0)\n", yes(f.fma),
              yes(f.avx512f), yes(f.avx512_bf16), yes(f.amx_bf16));
  s += format("clock: %.2f GHz measured (a chain of dependent adds, one per cycle; best of %d trials); "
              "/proc/cpuinfo says %.2f GHz\n",
              m.clock_hz / 1e9, kTrials, m.reported_clock_hz / 1e9);
  s += "peak bf16: " + cpu_peak_flops(DType::bf16, cores).derivation + "\n";
  s += "peak fp32: " + cpu_peak_flops(DType::f32, cores).derivation + "\n";
  return s;
}

}  // namespace anvil
