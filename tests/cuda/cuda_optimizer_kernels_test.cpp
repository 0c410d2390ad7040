// The optimizer step's kernels (ops/cuda: casts, AdamW, gradient norm) against
// the CPU ops. The host tests run each kernel's body over the kernel's whole
// grid on the CPU (kernel_body.h), on sizes that leave a partial block and,
// where the grid is capped, a grid-stride remainder; the GPU tests (skipped
// without a GPU) run the real kernels on the same inputs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <span>
#include <vector>

#include "anvil/core/dtype.h"
#include "anvil/core/tensor.h"
#include "anvil/ops/adamw.h"
#include "anvil/ops/cuda/adamw.h"
#include "anvil/ops/cuda/adamw_body.h"
#include "anvil/ops/cuda/cast.h"
#include "anvil/ops/cuda/cast_body.h"
#include "anvil/ops/cuda/grad_norm.h"
#include "anvil/ops/cuda/grad_norm_body.h"
#include "anvil/ops/grad_norm.h"
#include "cuda_test_util.h"
#include "kernel_check_util.h"

namespace {

using namespace anvil;
using anvil::kernel::LaunchShape;
using anvil::kernel::ThreadPos;
using anvil::testing::DeviceArray;
using anvil::testing::dtype_for;
using anvil::testing::values;

// Random values around `scale`, both signs, with a sprinkling of exact zeros.
std::vector<float> random_floats(int64_t n, float scale, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> x(static_cast<size_t>(n));
  for (float& v : x) v = rng() % 97 == 0 ? 0.0f : dist(rng);
  return x;
}

std::vector<uint16_t> to_bf16_bits(const std::vector<float>& x) {
  std::vector<uint16_t> b(x.size());
  for (size_t i = 0; i < x.size(); ++i) b[i] = bf16::from_float(x[i]);
  return b;
}

// Bit patterns of every kind: ties both ways, subnormals, overflow, infinities,
// NaNs with payloads, then random bits; n is not a multiple of any block.
std::vector<float> awkward_floats(int64_t n) {
  std::vector<float> x = {0.0f, -0.0f, 1.0f, -1.0f, 1.00390625f /* tie, rounds down to even */,
                          1.01171875f /* tie, rounds up to even */, 3.3895314e38f /* largest bf16 */,
                          std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::min(),
                          std::numeric_limits<float>::max() /* rounds to inf */,
                          std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::signaling_NaN()};
  std::mt19937 rng(11);
  while (static_cast<int64_t>(x.size()) < n) {
    const uint32_t u = rng();
    float f;
    std::memcpy(&f, &u, 4);
    x.push_back(f);
  }
  return x;
}

Tensor f32_tensor(const std::vector<float>& x) {
  Tensor t = Tensor::empty({static_cast<int64_t>(x.size())}, DType::f32, MemCategory::workspace, "x");
  std::memcpy(t.raw(), x.data(), t.nbytes());
  return t;
}
Tensor bf16_tensor(const std::vector<uint16_t>& x) {
  Tensor t = Tensor::empty({static_cast<int64_t>(x.size())}, DType::bf16, MemCategory::workspace, "x");
  std::memcpy(t.raw(), x.data(), t.nbytes());
  return t;
}
bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// How many elements differ in their bits, reporting the first few.
template <class T>
size_t count_bit_mismatches(const std::vector<T>& got, const std::vector<T>& want, const char* what) {
  EXPECT_EQ(got.size(), want.size()) << what;
  size_t bad = 0;
  for (size_t i = 0; i < got.size() && i < want.size(); ++i)
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0 && ++bad <= 3)
      ADD_FAILURE() << what << "[" << i << "]: got " << got[i] << ", want " << want[i];
  return bad;
}

constexpr int64_t kOddN = 100003;  // a partial last block of 256

// ---- casts ----

TEST(CudaCastBody, F32ToBf16IsBf16FromFloatOnTheWholeGrid) {
  const std::vector<float> in = awkward_floats(kOddN);
  // The kernel's own grid, and a 3-block grid whose threads stride over the rest.
  for (const LaunchShape& s : {kernel::cast_launch_shape(kOddN), LaunchShape{{3, 1}, {256, 1}}}) {
    std::vector<uint16_t> out(in.size(), 0xdead);
    kernel::for_each_thread_on_host(s, [&](const ThreadPos& p) { kernel::cast_f32_to_bf16_body(p, in.data(), out.data(), kOddN); });
    EXPECT_EQ(count_bit_mismatches(out, to_bf16_bits(in), "bf16"), 0u) << s.grid.x << " blocks";
  }
}

TEST(CudaCastBody, Bf16ToF32IsExactForEveryBitPattern) {
  std::vector<uint16_t> in(65536 + 77);  // every pattern, then a tail
  for (size_t i = 0; i < in.size(); ++i) in[i] = static_cast<uint16_t>(i * 40503u);
  std::vector<float> out(in.size()), want(in.size());
  kernel::for_each_thread_on_host(kernel::cast_launch_shape(static_cast<int64_t>(in.size())), [&](const ThreadPos& p) {
    kernel::cast_bf16_to_f32_body(p, in.data(), out.data(), static_cast<int64_t>(in.size()));
  });
  for (size_t i = 0; i < in.size(); ++i) want[i] = bf16::to_float(in[i]);
  EXPECT_TRUE(same_bits(out, want));
}

TEST(CudaCastKernel, BothWaysEqualTheCpuConversionBitForBit) {
  SKIP_WITHOUT_GPU();
  const std::vector<float> in = awkward_floats(kOddN);
  const DeviceArray<float> d_in(in);
  const DeviceArray<uint16_t> d_bf16(std::vector<uint16_t>(in.size()));
  const DeviceArray<float> d_back(std::vector<float>(in.size()));
  cast_f32_to_bf16_cuda(d_in.get(), d_bf16.get(), kOddN, nullptr);
  cast_bf16_to_f32_cuda(d_bf16.get(), d_back.get(), kOddN, nullptr);
  const std::vector<uint16_t> bf = d_bf16.download();
  EXPECT_EQ(count_bit_mismatches(bf, to_bf16_bits(in), "bf16"), 0u);  // NaN payloads included
  std::vector<float> want(in.size());
  for (size_t i = 0; i < in.size(); ++i) want[i] = bf16::to_float(bf[i]);
  EXPECT_TRUE(same_bits(d_back.download(), want));
}

// ---- AdamW ----

struct AdamWCase {
  AdamWConfig cfg{3e-3f, 0.9f, 0.95f, 1e-8f, 0.1f};
  std::vector<float> p, g, m, v;
  std::vector<uint16_t> p_bf16;
  explicit AdamWCase(int64_t n)
      : p(random_floats(n, 0.02f, 1)), g(random_floats(n, 1e-3f, 2)), m(random_floats(n, 1e-4f, 3)),
        v(random_floats(n, 1e-6f, 4)), p_bf16(static_cast<size_t>(n)) {
    for (float& x : v) x = x * x;  // a second moment is a mean of squares: ≥ 0, some exactly 0
  }
};

// Three steps of adamw_step, with and without the bf16 copy and clipping.
struct AdamWStep {
  int64_t t;
  float grad_scale;
  bool with_bf16;
};
constexpr AdamWStep kAdamWSteps[] = {{1, 1.0f, true}, {2, 0.37f, false}, {1000, 0.81f, true}};

void cpu_adamw(AdamWCase& c, const AdamWStep& s) {
  Tensor p = f32_tensor(c.p), g = f32_tensor(c.g), m = f32_tensor(c.m), v = f32_tensor(c.v), pb = bf16_tensor(c.p_bf16);
  adamw_step(c.cfg, s.t, p, g, m, v, s.with_bf16 ? &pb : nullptr, s.grad_scale);
  c.p = values<float>(p), c.m = values<float>(m), c.v = values<float>(v), c.p_bf16 = values<uint16_t>(pb);
}

// Both of adamw_step's paths (AVX-512 and portable) write their FMAs out with
// the body's roundings, so every bit must agree, the bf16 copy's included.
void expect_same_step(const AdamWCase& got, const AdamWCase& want, const AdamWStep& st) {
  EXPECT_EQ(count_bit_mismatches(got.m, want.m, "m"), 0u) << "step " << st.t;
  EXPECT_EQ(count_bit_mismatches(got.v, want.v, "v"), 0u) << "step " << st.t;
  EXPECT_EQ(count_bit_mismatches(got.p, want.p, "p"), 0u) << "step " << st.t;
  EXPECT_EQ(count_bit_mismatches(got.p_bf16, want.p_bf16, "p_bf16"), 0u) << "step " << st.t;
}

TEST(CudaAdamWBody, EqualsAdamwStepOnTheWholeGrid) {
  for (const LaunchShape& s : {kernel::adamw_launch_shape(kOddN), LaunchShape{{2, 1}, {256, 1}}}) {
    AdamWCase cpu(kOddN);
    for (const AdamWStep& st : kAdamWSteps) {
      const AdamWCase before = cpu;
      AdamWCase host = before;
      const AdamWCoeffs c = adamw_coeffs(host.cfg, st.t, st.grad_scale);
      uint16_t* pb = st.with_bf16 ? host.p_bf16.data() : nullptr;
      kernel::for_each_thread_on_host(s, [&](const ThreadPos& pos) {
        kernel::adamw_body(pos, c, host.p.data(), host.g.data(), host.m.data(), host.v.data(), pb, kOddN);
      });
      cpu_adamw(cpu, st);
      expect_same_step(host, cpu, st);
    }
  }
}

TEST(CudaAdamWKernel, EqualsAdamwStep) {
  SKIP_WITHOUT_GPU();
  AdamWCase cpu(kOddN);
  const DeviceArray<float> p(cpu.p), g(cpu.g), m(cpu.m), v(cpu.v);
  const DeviceArray<uint16_t> pb(cpu.p_bf16);
  for (const AdamWStep& st : kAdamWSteps) {
    const AdamWCase before = cpu;
    p.upload(before.p), m.upload(before.m), v.upload(before.v), pb.upload(before.p_bf16);
    adamw_step_cuda(before.cfg, st.t, p.get(), g.get(), m.get(), v.get(), st.with_bf16 ? pb.get() : nullptr, kOddN,
                    st.grad_scale, nullptr);
    AdamWCase gpu = before;
    gpu.p = p.download(), gpu.m = m.download(), gpu.v = v.download(), gpu.p_bf16 = pb.download();
    cpu_adamw(cpu, st);
    expect_same_step(gpu, cpu, st);
  }
}

TEST(CudaAdamWKernel, RejectsWhatAdamwStepRejects) {
  AdamWCase c(1);
  // Checked before any launch, so no GPU is needed.
  EXPECT_THROW(adamw_step_cuda(c.cfg, 0, nullptr, nullptr, nullptr, nullptr, nullptr, 1, 1.0f, nullptr), Error);
  EXPECT_THROW(adamw_step_cuda(c.cfg, 1, nullptr, nullptr, nullptr, nullptr, nullptr, 1,
                               std::numeric_limits<float>::quiet_NaN(), nullptr),
               Error);
}

// ---- gradient norm ----

// The two phased kernels of grad_sum_of_squares_cuda, run on the host.
template <class T>
double host_sum_of_squares(const std::vector<T>& x) {
  const int64_t n = static_cast<int64_t>(x.size());
  const LaunchShape s = kernel::sum_squares_launch_shape(n);
  std::vector<double> partials(s.grid.x);
  kernel::block_reduction_on_host<double>(
      s, [&](const ThreadPos& p) { return kernel::sum_squares_partial(p, x.data(), n); },
      [&](const ThreadPos& p, double total) { kernel::write_block_total(p, total, partials.data()); });
  double out = -1;
  kernel::block_reduction_on_host<double>(
      kernel::sum_partials_launch_shape(),
      [&](const ThreadPos& p) { return kernel::sum_partials_partial(p, partials.data(), s.grid.x); },
      [&](const ThreadPos& p, double total) { kernel::write_block_total(p, total, &out); });
  return out;
}

// Σ x² in long double (64-bit significands): a reference ~2^11 times finer
// than the double sums compared with it.
template <class T>
long double reference_sum_of_squares(const std::vector<T>& x) {
  long double acc = 0;
  for (const T& v : x) {
    const long double f = kernel::load_f32(&v, 0);
    acc += f * f;
  }
  return acc;
}

// Any order of summing n non-negative doubles is within (n − 1)·u·Σ of the
// exact sum (u = 2^-53; Higham, "Accuracy and Stability of Numerical
// Algorithms", 4.2); the squares themselves are exact.
template <class T>
void check_sum_of_squares(const std::vector<T>& x, const Tensor& cpu_tensor, const char* what) {
  const double host = host_sum_of_squares(x);
  const double cpu = grad_sum_of_squares(std::span<const Tensor>(&cpu_tensor, 1));
  const long double ref = reference_sum_of_squares(x);
  const long double bound = static_cast<long double>(x.size() - 1) * std::ldexp(1.0L, -53) * ref;
  const long double host_err = std::fabs(host - ref), cpu_err = std::fabs(cpu - ref);
  std::printf("%s n=%zu: host-run relative error %.3Lg, CPU op %.3Lg (bound %.3Lg)\n", what, x.size(),
              host_err / ref, cpu_err / ref, bound / ref);
  EXPECT_LE(host_err, bound) << what;
  EXPECT_LE(cpu_err, bound) << what;
}

constexpr int64_t kNormN = 300007;  // more blocks than the cap: the grid-stride loop runs

TEST(CudaGradNormBody, SumOfSquaresIsWithinTheSummationBound) {
  const std::vector<float> x = random_floats(kNormN, 3.0f, 5);
  check_sum_of_squares(x, f32_tensor(x), "f32");
  const std::vector<uint16_t> b = to_bf16_bits(x);
  check_sum_of_squares(b, bf16_tensor(b), "bf16");
  EXPECT_EQ(host_sum_of_squares(std::vector<float>(7, 0.0f)), 0.0);
  EXPECT_EQ(host_sum_of_squares(std::vector<float>{}), 0.0);
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<float> with_inf = x;
  with_inf[kNormN - 1] = std::numeric_limits<float>::infinity();
  EXPECT_EQ(host_sum_of_squares(with_inf), inf);  // nothing hides a broken gradient
  with_inf[5] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(host_sum_of_squares(with_inf)));
}

template <class T>
void host_scale(std::vector<T>& x, float s) {
  const int64_t n = static_cast<int64_t>(x.size());
  kernel::for_each_thread_on_host(kernel::scale_launch_shape(n), [&](const ThreadPos& p) { kernel::scale_body(p, x.data(), n, s); });
}

TEST(CudaGradNormBody, ScaleEqualsScaleGradsBitForBit) {
  std::vector<float> x = random_floats(kOddN, 2.0f, 6);
  std::vector<uint16_t> b = to_bf16_bits(random_floats(kOddN, 2.0f, 7));
  Tensor xt = f32_tensor(x), bt = bf16_tensor(b);
  const Tensor both[] = {xt, bt};
  scale_grads_(both, 0.3f);
  host_scale(x, 0.3f);
  host_scale(b, 0.3f);
  EXPECT_EQ(count_bit_mismatches(x, values<float>(xt), "f32"), 0u);
  EXPECT_EQ(count_bit_mismatches(b, values<uint16_t>(bt), "bf16"), 0u);
}

TEST(CudaGradNormKernel, EqualsTheHostRunBitForBit) {
  SKIP_WITHOUT_GPU();
  const std::vector<float> x = random_floats(kNormN, 3.0f, 5);
  const std::vector<uint16_t> b = to_bf16_bits(x);
  const DeviceArray<float> dx(x);
  const DeviceArray<uint16_t> db(b);
  const DeviceArray<double> workspace(std::vector<double>(static_cast<size_t>(grad_sum_of_squares_workspace())));
  const DeviceArray<double> out(std::vector<double>(2, -1.0));
  grad_sum_of_squares_cuda(dx.get(), kNormN, workspace.get(), out.get(), nullptr);
  grad_sum_of_squares_cuda(db.get(), kNormN, workspace.get(), out.get() + 1, nullptr);
  const std::vector<double> got = out.download();
  EXPECT_EQ(got[0], host_sum_of_squares(x));  // block_sum adds as block_sum_on_host does
  EXPECT_EQ(got[1], host_sum_of_squares(b));

  std::vector<float> xs = x;
  std::vector<uint16_t> bs = b;
  scale_grads_cuda(dx.get(), kNormN, 0.3f, nullptr);
  scale_grads_cuda(db.get(), kNormN, 0.3f, nullptr);
  host_scale(xs, 0.3f);
  host_scale(bs, 0.3f);
  EXPECT_EQ(count_bit_mismatches(dx.download(), xs, "f32"), 0u);
  EXPECT_EQ(count_bit_mismatches(db.download(), bs, "bf16"), 0u);
}

}  // namespace
