// The layers' element-wise and row kernels (ops/cuda: SwiGLU, RoPE, RMSNorm)
// against the CPU ops. Their arithmetic (exp, FMA contraction, summation
// order) is not the CPU op's operation for operation, so the host runs of the
// bodies, the CPU ops and (skipped without a GPU) the real kernels are each
// compared with a double-precision reference, within an error bound derived
// for each output and stated where it is checked, in units of u = 2^-24
// times the magnitude the rounding errors scale with; bf16 outputs add their
// one final rounding, 2^-8 relative (bf16 keeps 8 significant bits).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#include "anvil/core/dtype.h"
#include "anvil/core/tensor.h"
#include "anvil/ops/cuda/rope.h"
#include "anvil/ops/cuda/rope_body.h"
#include "anvil/ops/cuda/swiglu.h"
#include "anvil/ops/cuda/swiglu_body.h"
#include "anvil/ops/rope.h"
#include "anvil/ops/swiglu.h"
#include "cuda_test_util.h"
#include "kernel_check_util.h"

namespace {

using namespace anvil;
using anvil::kernel::LaunchShape;
using anvil::kernel::ThreadPos;
using anvil::testing::DeviceArray;
using namespace anvil::testing;

// ---- SwiGLU ----

constexpr int64_t kSwigluN = 100003;  // a partial last block

// Bounds. Each rounding is within u of its result, and an ulp within 2u, so
// expf (≤ 2 ulp on the device, < 1 on the host) is within 4u: e = exp(−|z|)
// 4u; 1 + e (e/(1 + e) ≤ 1/2) 3u; r = 1/(1 + e) 4u; s and 1 − s (e·r or r)
// 9u; h = z·s·u and du = dh·z·s two products more, 11u relative: 12u. dg =
// dh·u·s·(1 + z(1−s)) cancels where 1 + z(1−s) → 0 (z ≈ −1.28), so its bound
// is relative to the terms' magnitudes, |dh·u·s|·(1 + |z(1−s)|): z(1−s) 10u,
// the sum 11u of (1 + |z(1−s)|), s 9u, three products 3u: 23u, so 24u.
struct SwigluRef {
  std::vector<double> h, dg, du, h_scale, dg_scale, du_scale;
};

template <class T>
SwigluRef swiglu_reference(const std::vector<T>& dh, const std::vector<T>& g, const std::vector<T>& u) {
  SwigluRef r;
  for (size_t i = 0; i < g.size(); ++i) {
    const double z = value_of(g[i]), up = value_of(u[i]), d = value_of(dh[i]);
    const double s = 1 / (1 + std::exp(-z)), oms = 1 - s;
    r.h.push_back(z * s * up), r.h_scale.push_back(std::fabs(z * s * up));
    r.du.push_back(d * z * s), r.du_scale.push_back(std::fabs(d * z * s));
    r.dg.push_back(d * up * s * (1 + z * oms)), r.dg_scale.push_back(std::fabs(d * up * s) * (1 + std::fabs(z * oms)));
  }
  return r;
}

template <class T>
void check_swiglu(const std::string& what, const std::vector<T>& dh, const std::vector<T>& g, const std::vector<T>& u,
                  const std::vector<T>& h, const std::vector<T>& dg, const std::vector<T>& du) {
  const SwigluRef r = swiglu_reference(dh, g, u);
  expect_within(what + " h", h, r.h, r.h_scale, 12);
  expect_within(what + " du", du, r.du, r.du_scale, 12);
  expect_within(what + " dg", dg, r.dg, r.dg_scale, 24);
}

template <class T>
struct SwigluInputs {
  // Gates over a wide range (±80 and beyond in the tails) so both signs of the
  // sigmoid's split and its saturation are covered.
  std::vector<T> g = random_storage<T>(kSwigluN, 6.0f, 1), u = random_storage<T>(kSwigluN, 1.0f, 2),
                 dh = random_storage<T>(kSwigluN, 1.0f, 3);
  SwigluInputs() {
    const float wide[] = {80.0f, -80.0f, 1e4f, -1e4f, 0.0f, -1.2784645f};
    for (size_t i = 0; i < std::size(wide); ++i) g[i * 7] = std::is_same_v<T, float> ? T(wide[i]) : T(bf16::from_float(wide[i]));
  }
};

template <class T>
void swiglu_on_host_and_cpu() {
  const SwigluInputs<T> in;
  std::vector<T> h(kSwigluN), dg(kSwigluN), du(kSwigluN);
  for (const LaunchShape& s : {kernel::swiglu_launch_shape(kSwigluN), LaunchShape{{3, 1}, {256, 1}}}) {
    kernel::for_each_thread_on_host(s, [&](const ThreadPos& p) {
      kernel::swiglu_forward_body(p, in.g.data(), in.u.data(), h.data(), kSwigluN);
      kernel::swiglu_backward_body(p, in.dh.data(), in.g.data(), in.u.data(), dg.data(), du.data(), kSwigluN);
    });
    check_swiglu(std::string("host ") + dtype_name(dtype_for<T>()) + " " + std::to_string(s.grid.x) + " blocks",
                 in.dh, in.g, in.u, h, dg, du);
  }
  Tensor tg = tensor_of(in.g, {kSwigluN}), tu = tensor_of(in.u, {kSwigluN}), tdh = tensor_of(in.dh, {kSwigluN});
  Tensor th = tensor_of(h, {kSwigluN}), tdg = tensor_of(dg, {kSwigluN}), tdu = tensor_of(du, {kSwigluN});
  swiglu_forward(tg, tu, th);
  swiglu_backward(tdh, tg, tu, tdg, tdu);
  check_swiglu(std::string("CPU op ") + dtype_name(dtype_for<T>()), in.dh, in.g, in.u, values<T>(th), values<T>(tdg),
               values<T>(tdu));
}

TEST(CudaSwigluBody, WithinTheBoundLikeTheCpuOp) {
  swiglu_on_host_and_cpu<float>();
  swiglu_on_host_and_cpu<uint16_t>();
}

template <class T>
void swiglu_on_gpu() {
  const SwigluInputs<T> in;
  const std::vector<T> zeros(kSwigluN);
  const DeviceArray<T> g(in.g), u(in.u), dh(in.dh), h(zeros), dg(zeros), du(zeros);
  swiglu_forward_cuda(g.get(), u.get(), h.get(), kSwigluN, nullptr);
  swiglu_backward_cuda(dh.get(), g.get(), u.get(), dg.get(), du.get(), kSwigluN, nullptr);
  check_swiglu(std::string("GPU ") + dtype_name(dtype_for<T>()), in.dh, in.g, in.u, h.download(), dg.download(),
               du.download());
}

TEST(CudaSwigluKernel, WithinTheBound) {
  SKIP_WITHOUT_GPU();
  swiglu_on_gpu<float>();
  swiglu_on_gpu<uint16_t>();
}

// ---- RoPE ----

// Odd everywhere: D/2 = 23 pairs per head, 5 heads, 37 tokens per sequence
// (B·T = 111 blocks of rows), and a position offset.
constexpr int64_t kB = 3, kT = 37, kH = 5, kHeadDim = 46, kPosOffset = 4, kMaxPositions = 50;

// The reference rotates in double with the table's own f32 cos/sin. Each
// output is one product rounded (within u of it), the other fused, the sum
// rounded once (within u of it): y1 within 2u·(|x1·cos| + |x2·sin|), y2 within
// 2u·(|x2·cos| + |x1·sin|).
template <class T>
void check_rope(const std::string& what, const std::vector<T>& x, const RopeTable& table, bool inverse,
                const std::vector<T>& y) {
  const int64_t half = kHeadDim / 2;
  const float* c = table.cos.data<float>();
  const float* sn = table.sin.data<float>();
  std::vector<double> ref(x.size()), scale(x.size());
  for (int64_t bt = 0; bt < kB * kT; ++bt)
    for (int64_t h = 0; h < kH; ++h)
      for (int64_t i = 0; i < half; ++i) {
        const size_t at = static_cast<size_t>((bt * kH + h) * kHeadDim + i), at2 = at + static_cast<size_t>(half);
        const int64_t p = kPosOffset + bt % kT;
        const double cv = c[p * half + i], sv = (inverse ? -1.0 : 1.0) * sn[p * half + i];
        const double x1 = value_of(x[at]), x2 = value_of(x[at2]);
        ref[at] = x1 * cv - x2 * sv, ref[at2] = x2 * cv + x1 * sv;
        scale[at] = std::fabs(x1 * cv) + std::fabs(x2 * sv), scale[at2] = std::fabs(x2 * cv) + std::fabs(x1 * sv);
      }
  expect_within(what, y, ref, scale, 2);
}

template <class T>
void rope_on_host_and_cpu() {
  const RopeTable table = rope_table(kMaxPositions, kHeadDim, 10000.0);
  const std::vector<T> x = random_storage<T>(kB * kT * kH * kHeadDim, 1.0f, 7);
  const int64_t tokens = kB * kT, pairs = kH * kHeadDim / 2;
  const std::string type = dtype_name(dtype_for<T>());
  for (const bool inverse : {false, true}) {
    const std::string dir = inverse ? " backward" : " forward";
    for (const LaunchShape& s : {kernel::rope_launch_shape(tokens, pairs), LaunchShape{{1, 8}, {32, 1}}}) {
      std::vector<T> y(x.size());
      kernel::for_each_thread_on_host(s, [&](const ThreadPos& p) {
        if (inverse)
          kernel::rope_body<true>(p, x.data(), table.cos.data<float>(), table.sin.data<float>(), tokens, kT, kH,
                                  kHeadDim, kPosOffset, y.data());
        else
          kernel::rope_body<false>(p, x.data(), table.cos.data<float>(), table.sin.data<float>(), tokens, kT, kH,
                                   kHeadDim, kPosOffset, y.data());
      });
      check_rope("host " + type + dir + " " + std::to_string(s.grid.x * s.grid.y) + " blocks", x, table, inverse, y);
    }
    const Tensor tx = tensor_of(x, {kB, kT, kH, kHeadDim});
    Tensor ty = tensor_of(x, {kB, kT, kH, kHeadDim});
    if (inverse)
      rope_backward(tx, table, kPosOffset, ty);
    else
      rope_forward(tx, table, kPosOffset, ty);
    check_rope("CPU op " + type + dir, x, table, inverse, values<T>(ty));
  }
}

TEST(CudaRopeBody, WithinTheBoundLikeTheCpuOp) {
  rope_on_host_and_cpu<float>();
  rope_on_host_and_cpu<uint16_t>();
}

template <class T>
void rope_on_gpu() {
  const RopeTable table = rope_table(kMaxPositions, kHeadDim, 10000.0);
  const std::vector<T> x = random_storage<T>(kB * kT * kH * kHeadDim, 1.0f, 7);
  const DeviceArray<float> c(values<float>(table.cos)), sn(values<float>(table.sin));
  const DeviceArray<T> dx(x), y(x);
  rope_forward_cuda(dx.get(), c.get(), sn.get(), kMaxPositions, kB, kT, kH, kHeadDim, kPosOffset, y.get(), nullptr);
  check_rope(std::string("GPU forward ") + dtype_name(dtype_for<T>()), x, table, false, y.download());
  rope_backward_cuda(dx.get(), c.get(), sn.get(), kMaxPositions, kB, kT, kH, kHeadDim, kPosOffset, dx.get(), nullptr);
  check_rope(std::string("GPU backward in place ") + dtype_name(dtype_for<T>()), x, table, true, dx.download());
}

TEST(CudaRopeKernel, WithinTheBound) {
  SKIP_WITHOUT_GPU();
  rope_on_gpu<float>();
  rope_on_gpu<uint16_t>();
}

TEST(CudaRopeKernel, RejectsPositionsOutsideTheTable) {
  // Checked before any launch, so no GPU is needed.
  EXPECT_THROW(rope_forward_cuda<float>(nullptr, nullptr, nullptr, kT - 1, 1, kT, 1, 4, 0, nullptr, nullptr), Error);
  EXPECT_THROW(rope_forward_cuda<float>(nullptr, nullptr, nullptr, kMaxPositions, 1, kT, 1, 4, -1, nullptr, nullptr),
               Error);
}

}  // namespace
