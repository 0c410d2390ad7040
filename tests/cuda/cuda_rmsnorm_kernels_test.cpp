// RMSNorm's block programs (ops/cuda/rmsnorm_body.h) run on the host over the
// kernels' whole grids, the CPU op, and (skipped without a GPU) the kernels,
// each against a double-precision reference within a bound derived below, and
// the kernels against the host runs bit for bit.
//
// Bounds, in units of u = 2^-24. Each rounding is within u of its result. A
// sum whose every term passes through at most k roundings (the products that
// make it and the additions after) is within k·u of the sum of the terms'
// magnitudes (to first order; one u more covers the second-order terms, k²u²,
// for every k here). k differs by implementation:
//   kernels: per thread ⌈D/256⌉ fused steps, then block_sum's 8 levels;
//   CPU op (vec16): Σx² in four 16-lane accumulators of ⌈D/64⌉ + 1 steps, two
//   pairings, a 16-lane horizontal sum (15); the dot in one accumulator of
//   ⌈D/16⌉ steps, one pairing and the 15; one more rounding per product.
// rstd = 1/sqrt(Σx²/D + eps): k for Σx², +1 the division, +1 eps (positive),
// sqrt halves the relative error and adds 1, the reciprocal 1: (k + 2)/2 + 2,
// +1. y = (x·r)·w: two products more, relative to |y|.
// dx = r·dy·w − (r³/D)·dot·x: relative to |r·dy·w| + |x|·(r³/D)·Σ|dy·w·x|,
// the first term 2 roundings, the second k (dot) + 4 (r³/D·dot), the result 1
// (or 2 unfused), +1; accumulate_dx adds |dx| to the scale and a rounding.
// dw_j + Σ_m dy·x·r: relative to |dw_j| + Σ|dy·x·r|; each term 2 roundings,
// then at most the chain of additions it passes: kernels, the rest of its
// split (< 16), the split sums (splits) and dw (1); the CPU op, its one chunk
// (M rows at this D) and dw.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "anvil/ops/cuda/rmsnorm.h"
#include "anvil/ops/cuda/rmsnorm_body.h"
#include "anvil/ops/rmsnorm.h"
#include "cuda_test_util.h"
#include "kernel_check_util.h"

namespace {

using namespace anvil;
using namespace anvil::testing;
using anvil::kernel::LaunchShape;
using anvil::kernel::ThreadPos;

// Odd everywhere: 4 dw splits, the last of 5 rows; 3 or 4 columns per thread.
constexpr int64_t kM = 53, kD = 777;
constexpr float kEps = 1e-5f;
const int64_t kSplits = kernel::rmsnorm_dw_splits(kM);

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
// The chains (above) of each implementation's sums.
const double kKernelChain = static_cast<double>(ceil_div(kD, kernel::kRmsnormThreads) + 8);
const double kCpuSquaresChain = static_cast<double>(ceil_div(kD, 64) + 19);
const double kCpuDotChain = static_cast<double>(ceil_div(kD, 16) + 17);

// (chain for Σx², chain for the dot, chain of dw's additions)
struct Chains {
  double squares, dot, dw;
};
const Chains kKernelChains{kKernelChain, kKernelChain + 1, kernel::kRmsnormRowsPerSplit + kSplits + 1.0};
const Chains kCpuChains{kCpuSquaresChain, kCpuDotChain + 1, kM + 2.0};

template <class T>
struct Inputs {
  std::vector<T> x, w, dy;
  Inputs() : x(kM * kD), w(random_storage<T>(kD, 1.0f, 12)), dy(random_storage<T>(kM * kD, 1.0f, 13)) {
    // Rows from 1e-3 to 1e3 in magnitude (rstd over six decades), one all zero.
    std::mt19937 rng(11);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    for (int64_t m = 0; m < kM; ++m) {
      const float row_scale = m == 5 ? 0.0f : std::pow(10.0f, static_cast<float>(m % 7 - 3));
      for (int64_t j = 0; j < kD; ++j) x[m * kD + j] = stored<T>(dist(rng) * row_scale);
    }
  }
};

// ---- forward ----

template <class T>
void check_forward(const std::string& what, const Inputs<T>& in, const std::vector<T>& y, const std::vector<float>& rstd,
                   const Chains& k) {
  std::vector<double> ref_y(y.size()), scale_y(y.size()), ref_r(kM), scale_r(kM);
  for (int64_t m = 0; m < kM; ++m) {
    double ss = 0;
    for (int64_t j = 0; j < kD; ++j) ss += value_of(in.x[m * kD + j]) * value_of(in.x[m * kD + j]);
    const double r = 1 / std::sqrt(ss / kD + static_cast<double>(kEps));
    ref_r[m] = r, scale_r[m] = r;
    for (int64_t j = 0; j < kD; ++j) {
      const size_t i = static_cast<size_t>(m * kD + j);
      ref_y[i] = value_of(in.x[i]) * r * value_of(in.w[j]);
      scale_y[i] = std::fabs(ref_y[i]);
    }
  }
  expect_within(what + " rstd", rstd, ref_r, scale_r, (k.squares + 2) / 2 + 3);
  expect_within(what + " y", y, ref_y, scale_y, (k.squares + 2) / 2 + 5);
}

template <class T>
void forward_on_host(const LaunchShape& s, const Inputs<T>& in, std::vector<T>& y, std::vector<float>& rstd) {
  y.assign(in.x.size(), T{});
  rstd.assign(kM, 0.0f);
  kernel::for_each_block_on_host(s, [&](kernel::HostBlock& b) {
    kernel::rmsnorm_forward_program(b, in.x.data(), in.w.data(), kEps, y.data(), rstd.data(), kM, kD);
  });
}

template <class T>
void forward_on_host_and_cpu() {
  const Inputs<T> in;
  std::vector<T> y, y_few;
  std::vector<float> rstd, rstd_few;
  forward_on_host(kernel::rmsnorm_forward_launch_shape(kM), in, y, rstd);
  check_forward("host " + type_name<T>(), in, y, rstd, kKernelChains);
  // A grid smaller than the rows strides over them, and changes no bit.
  forward_on_host(LaunchShape{{3, 1}, {kernel::kRmsnormThreads, 1}}, in, y_few, rstd_few);
  expect_same_bits("host " + type_name<T>() + " y, 3 blocks", y_few, y);
  expect_same_bits("host " + type_name<T>() + " rstd, 3 blocks", rstd_few, rstd);

  const Tensor tx = tensor_of(in.x, {kM, kD}), tw = tensor_of(in.w, {kD});
  Tensor ty = tensor_of(y, {kM, kD}), tr = tensor_of(rstd, {kM});
  rmsnorm_forward(tx, tw, kEps, ty, tr);
  check_forward("CPU op " + type_name<T>(), in, values<T>(ty), values<float>(tr), kCpuChains);
}

TEST(CudaRmsnormBody, ForwardWithinTheBoundLikeTheCpuOp) {
  forward_on_host_and_cpu<float>();
  forward_on_host_and_cpu<uint16_t>();
}

// ---- backward ----

template <class T, class G>
struct BackwardState {
  std::vector<float> rstd;  // the forward's (host run), the backward's input everywhere
  std::vector<T> dx_before;
  std::vector<G> dw_before = random_storage<G>(kD, 1.0f, 15);
  explicit BackwardState(const Inputs<T>& in) : dx_before(random_storage<T>(kM * kD, 1.0f, 14)) {
    std::vector<T> y;
    forward_on_host(kernel::rmsnorm_forward_launch_shape(kM), in, y, rstd);
  }
};

template <class T, class G>
void check_backward(const std::string& what, const Inputs<T>& in, const BackwardState<T, G>& st, bool accumulate_dx,
                    const std::vector<T>& dx, const std::vector<G>& dw, const Chains& k) {
  std::vector<double> ref_dx(dx.size()), scale_dx(dx.size()), ref_dw(kD), scale_dw(kD);
  for (int64_t j = 0; j < kD; ++j) ref_dw[j] = value_of(st.dw_before[j]), scale_dw[j] = std::fabs(ref_dw[j]);
  for (int64_t m = 0; m < kM; ++m) {
    const double r = st.rstd[m];
    double dot = 0, dot_abs = 0;
    for (int64_t j = 0; j < kD; ++j) {
      const double t = value_of(in.dy[m * kD + j]) * value_of(in.w[j]) * value_of(in.x[m * kD + j]);
      dot += t, dot_abs += std::fabs(t);
    }
    const double c = r * r * r / kD;
    for (int64_t j = 0; j < kD; ++j) {
      const size_t i = static_cast<size_t>(m * kD + j);
      const double dy = value_of(in.dy[i]), x = value_of(in.x[i]), before = accumulate_dx ? value_of(st.dx_before[i]) : 0;
      ref_dx[i] = r * dy * value_of(in.w[j]) - c * dot * x + before;
      scale_dx[i] = std::fabs(r * dy * value_of(in.w[j])) + std::fabs(x) * c * dot_abs + std::fabs(before);
      ref_dw[j] += dy * x * r, scale_dw[j] += std::fabs(dy * x * r);
    }
  }
  expect_within(what + " dx", dx, ref_dx, scale_dx, k.dot + 7 + (accumulate_dx ? 1 : 0));
  expect_within(what + " dw", dw, ref_dw, scale_dw, k.dw + 3);
}

template <class T, class G>
void backward_on_host(const LaunchShape& s, const Inputs<T>& in, const BackwardState<T, G>& st, bool accumulate_dx,
                      std::vector<T>& dx, std::vector<G>& dw) {
  dx = st.dx_before, dw = st.dw_before;
  // Filled with NaN: every element the dw kernel reads must have been written.
  std::vector<float> scratch(static_cast<size_t>(rmsnorm_backward_scratch(kM, kD)), NAN);
  kernel::for_each_block_on_host(s, [&](kernel::HostBlock& b) {
    kernel::rmsnorm_backward_program(b, in.dy.data(), in.x.data(), in.w.data(), st.rstd.data(), dx.data(),
                                     scratch.data(), kM, kD, accumulate_dx);
  });
  kernel::for_each_thread_on_host(kernel::rmsnorm_dw_launch_shape(kD), [&](const ThreadPos& p) {
    kernel::rmsnorm_dw_body(p, scratch.data(), kSplits, kD, dw.data());
  });
}

template <class T, class G>
void backward_on_host_and_cpu() {
  const Inputs<T> in;
  const BackwardState<T, G> st(in);
  for (const bool accumulate_dx : {false, true}) {
    const std::string what = type_name<T>() + " dw " + type_name<G>() + (accumulate_dx ? " accumulating" : "");
    std::vector<T> dx, dx_few;
    std::vector<G> dw, dw_few;
    backward_on_host(kernel::rmsnorm_backward_launch_shape(kM), in, st, accumulate_dx, dx, dw);
    check_backward("host " + what, in, st, accumulate_dx, dx, dw, kKernelChains);
    // Fewer blocks than splits: the same bits, dw's included (its order is M's alone).
    backward_on_host(LaunchShape{{3, 1}, {kernel::kRmsnormThreads, 1}}, in, st, accumulate_dx, dx_few, dw_few);
    expect_same_bits("host " + what + " dx, 3 blocks", dx_few, dx);
    expect_same_bits("host " + what + " dw, 3 blocks", dw_few, dw);

    const Tensor tdy = tensor_of(in.dy, {kM, kD}), tx = tensor_of(in.x, {kM, kD}), tw = tensor_of(in.w, {kD});
    const Tensor tr = tensor_of(st.rstd, {kM});
    Tensor tdx = tensor_of(st.dx_before, {kM, kD}), tdw = tensor_of(st.dw_before, {kD});
    rmsnorm_backward(tdy, tx, tw, tr, kEps, tdx, tdw, accumulate_dx);
    check_backward("CPU op " + what, in, st, accumulate_dx, values<T>(tdx), values<G>(tdw), kCpuChains);
  }
}

TEST(CudaRmsnormBody, BackwardWithinTheBoundLikeTheCpuOp) {
  backward_on_host_and_cpu<float, float>();
  backward_on_host_and_cpu<uint16_t, float>();
  backward_on_host_and_cpu<uint16_t, uint16_t>();
}

// ---- the kernels ----

template <class T, class G>
void rmsnorm_on_gpu() {
  const Inputs<T> in;
  const BackwardState<T, G> st(in);
  std::vector<T> y_host;
  std::vector<float> rstd_host;
  forward_on_host(kernel::rmsnorm_forward_launch_shape(kM), in, y_host, rstd_host);

  const DeviceArray<T> x(in.x), w(in.w), dy(in.dy), y(std::vector<T>(in.x.size()));
  const DeviceArray<float> rstd{std::vector<float>(kM)};
  rmsnorm_forward_cuda(x.get(), w.get(), kEps, y.get(), rstd.get(), kM, kD, nullptr);
  const std::string type = type_name<T>();
  check_forward("GPU " + type, in, y.download(), rstd.download(), kKernelChains);
  expect_same_bits("GPU vs host " + type + " y", y.download(), y_host);
  expect_same_bits("GPU vs host " + type + " rstd", rstd.download(), rstd_host);

  const DeviceArray<float> scratch(std::vector<float>(static_cast<size_t>(rmsnorm_backward_scratch(kM, kD)), NAN));
  for (const bool accumulate_dx : {false, true}) {
    const std::string what = type + " dw " + type_name<G>() + (accumulate_dx ? " accumulating" : "");
    std::vector<T> dx_host;
    std::vector<G> dw_host;
    backward_on_host(kernel::rmsnorm_backward_launch_shape(kM), in, st, accumulate_dx, dx_host, dw_host);
    const DeviceArray<T> dx(st.dx_before);
    const DeviceArray<G> dw(st.dw_before);
    rstd.upload(st.rstd);
    rmsnorm_backward_cuda(dy.get(), x.get(), w.get(), rstd.get(), dx.get(), dw.get(), scratch.get(), kM, kD,
                          accumulate_dx, nullptr);
    check_backward("GPU " + what, in, st, accumulate_dx, dx.download(), dw.download(), kKernelChains);
    expect_same_bits("GPU vs host " + what + " dx", dx.download(), dx_host);
    expect_same_bits("GPU vs host " + what + " dw", dw.download(), dw_host);
  }
}

TEST(CudaRmsnormKernel, WithinTheBoundAndTheHostRunsBits) {
  SKIP_WITHOUT_GPU();
  rmsnorm_on_gpu<float, float>();
  rmsnorm_on_gpu<uint16_t, float>();
  rmsnorm_on_gpu<uint16_t, uint16_t>();
}

TEST(CudaRmsnormKernel, RejectsAMissingRstd) {
  // Checked before any launch, so no GPU is needed.
  EXPECT_THROW((rmsnorm_backward_cuda<float, float>(nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, kM,
                                                    kD, false, nullptr)),
               Error);
}

}  // namespace
