#include "anvil/ops/grad_norm.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>

#include "anvil/core/parallel_for.h"
#include "test_util.h"

namespace {
using namespace anvil;
using namespace anvil::testing;

double sum_squares_ref(const std::vector<Tensor>& ts) {
  double s = 0;
  for (const Tensor& t : ts)
    for (double x : to_double(t)) s += x * x;
  return s;
}

// Mixed dtypes and awkward sizes: single elements, sizes that are not
// multiples of 16 lanes, tensors split across the threads' ranges.
std::vector<Tensor> make_grads(bool with_bf16, float scale = 1.0f) {
  std::vector<Tensor> ts;
  const DType b = with_bf16 ? DType::bf16 : DType::f32;
  ts.push_back(random_tensor({1}, DType::f32, "g0", scale, MemCategory::gradients));
  ts.push_back(random_tensor({17}, b, "g1", scale, MemCategory::gradients));
  ts.push_back(random_tensor({3, 333}, DType::f32, "g2", scale, MemCategory::gradients));
  ts.push_back(random_tensor({1000, 1001}, b, "g3", 0.01f * scale, MemCategory::gradients));
  ts.push_back(random_tensor({65537}, DType::f32, "g4", 3.0f * scale, MemCategory::gradients));
  ts.push_back(random_tensor({5}, b, "g5", 100.0f * scale, MemCategory::gradients));
  ts.push_back(random_tensor({100003}, DType::f32, "g6", scale, MemCategory::gradients));
  return ts;
}

std::vector<Tensor> copies(const std::vector<Tensor>& ts) {
  std::vector<Tensor> out;
  for (const Tensor& t : ts) out.push_back(t.to(t.dtype(), MemCategory::workspace, "copy"));
  return out;
}
bool same_bits(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  for (size_t i = 0; i < a.size(); ++i)
    if (std::memcmp(a[i].raw(), b[i].raw(), a[i].nbytes()) != 0) return false;
  return true;
}

// Squares of f32/bf16 values are exact in double and the sums run in double,
// so the only error is double rounding over ~1e6 additions: ≪ 1e-12.
TEST(GradNorm, SumOfSquaresMatchesDouble) {
  for (bool with_bf16 : {false, true}) {
    const std::vector<Tensor> grads = make_grads(with_bf16);
    const double want = sum_squares_ref(grads);
    const double got = grad_sum_of_squares(grads);
    const double rel = std::abs(got - want) / want;
    std::printf("%s: sum of squares %.17g, want %.17g, rel error %.3g\n", with_bf16 ? "mixed f32/bf16" : "f32", got,
                want, rel);
    EXPECT_LT(rel, 1e-12);
    EXPECT_NEAR(grad_norm_from_sum_of_squares(got), std::sqrt(want), 1e-12 * std::sqrt(want));

    // One thread gives the same value up to double rounding.
    const int threads = num_threads();
    set_num_threads(1);
    const double one = grad_sum_of_squares(grads);
    set_num_threads(threads);
    EXPECT_LT(std::abs(one - want) / want, 1e-12);
  }
}

// Partial sums over disjoint groups add up to the whole: what a distributed
// caller relies on when it all-reduces the partial sums.
TEST(GradNorm, PartialSumsAddUp) {
  const std::vector<Tensor> grads = make_grads(true);
  const std::vector<Tensor> a(grads.begin(), grads.begin() + 3), b(grads.begin() + 3, grads.end());
  const double whole = grad_sum_of_squares(grads);
  EXPECT_NEAR(grad_sum_of_squares(a) + grad_sum_of_squares(b), whole, 1e-12 * whole);
  EXPECT_EQ(grad_sum_of_squares(std::vector<Tensor>{}), 0.0);
}

TEST(GradNorm, ClipCoefficient) {
  EXPECT_DOUBLE_EQ(clip_coefficient(10.0, 1.0), 1.0 / (10.0 + 1e-6));
  EXPECT_EQ(clip_coefficient(0.5, 1.0), 1.0);
  EXPECT_EQ(clip_coefficient(0.0, 1.0), 1.0);
  EXPECT_TRUE(std::isnan(clip_coefficient(std::numeric_limits<double>::quiet_NaN(), 1.0)));
  EXPECT_TRUE(std::isnan(clip_coefficient(std::numeric_limits<double>::infinity(), 1.0)));
  EXPECT_THROW(clip_coefficient(1.0, 0.0), Error);
  EXPECT_THROW(clip_coefficient(1.0, -1.0), Error);
  EXPECT_THROW(clip_coefficient(1.0, std::numeric_limits<double>::quiet_NaN()), Error);
}

// After clipping, the norm is max_norm·norm/(norm + 1e-6) ≈ max_norm.
TEST(GradNorm, ClipScalesToMaxNorm) {
  for (bool with_bf16 : {false, true}) {
    std::vector<Tensor> grads = make_grads(with_bf16);
    const double before = std::sqrt(sum_squares_ref(grads));
    const double max_norm = before / 3.7;
    const double returned = clip_grad_norm_(grads, max_norm);
    EXPECT_NEAR(returned, before, 1e-12 * before);  // the pre-clip norm
    const double after = std::sqrt(sum_squares_ref(grads));
    const double want = max_norm * before / (before + 1e-6);
    const double rel = std::abs(after - want) / want;
    std::printf("%s: norm %.6g clipped to %.9g, want %.9g, rel error %.3g\n", with_bf16 ? "mixed f32/bf16" : "f32",
                before, after, want, rel);
    // Each scaled f32 value is rounded once (≤ 2^-24 relative): 1e-6 is loose
    // enough. A rounded bf16 value is off by ≤ 2^-8 relative, so the norm of a
    // list with bf16 tensors can be off by at most 2^-8.
    EXPECT_LT(rel, with_bf16 ? std::ldexp(1.0, -8) : 1e-6);
  }
}

TEST(GradNorm, NoClipBelowMaxNorm) {
  std::vector<Tensor> grads = make_grads(true);
  const std::vector<Tensor> before = copies(grads);
  const double norm = std::sqrt(sum_squares_ref(grads));
  const double returned = clip_grad_norm_(grads, 2 * norm);
  EXPECT_NEAR(returned, norm, 1e-12 * norm);
  EXPECT_TRUE(same_bits(grads, before));
}

// scale_grads_ on bf16 is exactly bf16(float(x)·s), on f32 exactly x·s.
TEST(GradNorm, ScaleIsRoundedProduct) {
  std::vector<Tensor> grads = make_grads(true);
  const std::vector<Tensor> before = copies(grads);
  const float s = 0.3173f;
  scale_grads_(grads, s);
  for (size_t k = 0; k < grads.size(); ++k) {
    for (int64_t i = 0; i < grads[k].numel(); ++i) {
      const float x = before[k].item_f32(i) * s;
      if (grads[k].dtype() == DType::f32)
        ASSERT_EQ(grads[k].data<float>()[i], x) << k << " " << i;
      else
        ASSERT_EQ(grads[k].data<bf16>()[i].bits, bf16::from_float(x)) << k << " " << i;
    }
  }
}

// A NaN or Inf gradient is never hidden: the norm is NaN/Inf and the gradients
// are left as they were, for the trainer to stop and report.
TEST(GradNorm, NonFiniteGradientGivesNonFiniteNorm) {
  for (size_t which : {size_t{3}, size_t{6}}) {  // a bf16 tensor, an f32 tensor
    for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
      std::vector<Tensor> grads = make_grads(true);
      Tensor& t = grads[which];
      const int64_t i = t.numel() - 2;
      if (t.dtype() == DType::f32)
        t.data<float>()[i] = bad;
      else
        t.data<bf16>()[i] = bf16(bad);
      const std::vector<Tensor> before = copies(grads);
      const double ss = grad_sum_of_squares(grads);
      const double norm = clip_grad_norm_(grads, 1e-3);
      if (std::isnan(bad)) {
        EXPECT_TRUE(std::isnan(ss) && std::isnan(norm)) << which;
      } else {
        EXPECT_TRUE(std::isinf(ss) && std::isinf(norm)) << which;
      }
      EXPECT_TRUE(same_bits(grads, before)) << "gradients must be left untouched";
    }
  }
}

}  // namespace
