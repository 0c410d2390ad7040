#include "anvil/ops/swiglu.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <string>

#include "test_util.h"

namespace {
using namespace anvil;
using namespace anvil::testing;

// ---- double-precision reference ----
double sigmoid_ref(double z) { return z >= 0 ? 1.0 / (1.0 + std::exp(-z)) : std::exp(z) / (1.0 + std::exp(z)); }
double silu_ref(double z) { return z * sigmoid_ref(z); }
double dsilu_ref(double z) {
  const double s = sigmoid_ref(z);
  return s * (1.0 + z * (1.0 - s));
}

std::vector<double> forward_ref(const std::vector<double>& g, const std::vector<double>& u) {
  std::vector<double> h(g.size());
  for (size_t i = 0; i < g.size(); ++i) h[i] = silu_ref(g[i]) * u[i];
  return h;
}
void backward_ref(const std::vector<double>& dh, const std::vector<double>& g, const std::vector<double>& u,
                  std::vector<double>& dg, std::vector<double>& du) {
  dg.resize(g.size());
  du.resize(g.size());
  for (size_t i = 0; i < g.size(); ++i) {
    dg[i] = dh[i] * u[i] * dsilu_ref(g[i]);
    du[i] = dh[i] * silu_ref(g[i]);
  }
}

Tensor empty_like(const Tensor& t, const char* tag) { return Tensor::empty(t.shape(), t.dtype(), MemCategory::workspace, tag); }

// Awkward shapes: a single element, sizes that are not multiples of the
// 16-lane vectors, and one large enough to be split across threads.
const std::vector<Shape> kShapes = {{1, 1}, {1, 7}, {3, 17}, {5, 33}, {1, 100003}, {64, 1000}, {300, 517}};

// f32 tolerance: each output goes through exp (≈1 ulp), a reciprocal from a
// 14-bit estimate plus one Newton step (≈1 ulp) and two or three products, so
// a few f32 ulps (2^-24 ≈ 6e-8 each) per element; 1e-6 in norm is tight.
constexpr double kF32Tol = 1e-6;

TEST(SwiGLU, ForwardF32MatchesDouble) {
  for (const Shape& s : kShapes) {
    const std::string name = shape_str(s);
    Tensor g = random_tensor(s, DType::f32, "g" + name, 6.0f);  // z in [-6, 6): both sigmoid branches
    Tensor u = random_tensor(s, DType::f32, "u" + name, 2.0f);
    Tensor h = empty_like(g, "h");
    swiglu_forward(g, u, h);
    const double err = rel_error(h, forward_ref(to_double(g), to_double(u)));
    std::printf("forward f32 %s rel_error %.3g\n", name.c_str(), err);
    EXPECT_LT(err, kF32Tol) << name;
  }
}

TEST(SwiGLU, BackwardF32MatchesDouble) {
  for (const Shape& s : kShapes) {
    const std::string name = shape_str(s);
    Tensor g = random_tensor(s, DType::f32, "g" + name, 6.0f);
    Tensor u = random_tensor(s, DType::f32, "u" + name, 2.0f);
    Tensor dh = random_tensor(s, DType::f32, "dh" + name);
    Tensor dg = empty_like(g, "dg"), du = empty_like(g, "du");
    swiglu_backward(dh, g, u, dg, du);
    std::vector<double> dg_ref, du_ref;
    backward_ref(to_double(dh), to_double(g), to_double(u), dg_ref, du_ref);
    const double eg = rel_error(dg, dg_ref), eu = rel_error(du, du_ref);
    std::printf("backward f32 %s rel_error dg %.3g du %.3g\n", name.c_str(), eg, eu);
    EXPECT_LT(eg, kF32Tol) << name;
    EXPECT_LT(eu, kF32Tol) << name;
  }
}

// The op's f32 backward against central differences of the double forward of
// L = Σ w·h, whose gradient with respect to h is w (so dh = w).
TEST(SwiGLU, BackwardMatchesFiniteDifferences) {
  for (const Shape& s : std::vector<Shape>{{2, 3}, {1, 5}, {3, 4}}) {
    const std::string name = shape_str(s);
    Tensor g = random_tensor(s, DType::f32, "fd_g" + name, 4.0f);
    Tensor u = random_tensor(s, DType::f32, "fd_u" + name, 2.0f);
    Tensor w = random_tensor(s, DType::f32, "fd_w" + name);
    Tensor dg = empty_like(g, "dg"), du = empty_like(g, "du");
    swiglu_backward(w, g, u, dg, du);
    const std::vector<double> gd = to_double(g), ud = to_double(u), wd = to_double(w);
    const auto num_dg = numerical_grad([&](const std::vector<double>& x) { return weighted_sum(forward_ref(x, ud), wd); }, gd);
    const auto num_du = numerical_grad([&](const std::vector<double>& x) { return weighted_sum(forward_ref(gd, x), wd); }, ud);
    const double eg = rel_error(dg, num_dg), eu = rel_error(du, num_du);
    std::printf("finite differences %s rel_error dg %.3g du %.3g\n", name.c_str(), eg, eu);
    // Central differences with eps = 1e-6 in double are good to ~1e-9; the rest is f32.
    EXPECT_LT(eg, 1e-5) << name;
    EXPECT_LT(eu, 1e-5) << name;
  }
}

// Large |z| must neither overflow exp nor lose 1 − sigmoid to cancellation.
TEST(SwiGLU, LargeInputsStayFiniteAndCorrect) {
  const std::vector<float> zs = {80.0f, -80.0f, 50.0f, -50.0f, 20.0f, -20.0f, 88.5f, -88.5f, 100.0f, -100.0f,
                                 1e4f,  -1e4f,  1e30f, -1e30f, 15.0f, -15.0f, 0.0f,  -0.0f,  1e-30f, -1e-30f};
  const int64_t n = static_cast<int64_t>(zs.size());
  Tensor g = Tensor::empty({n}, DType::f32, MemCategory::workspace, "g");
  for (int64_t i = 0; i < n; ++i) g.data<float>()[i] = zs[static_cast<size_t>(i)];
  Tensor u = random_tensor({n}, DType::f32, "u_large", 2.0f);
  Tensor dh = random_tensor({n}, DType::f32, "dh_large");
  Tensor h = empty_like(g, "h"), dg = empty_like(g, "dg"), du = empty_like(g, "du");
  swiglu_forward(g, u, h);
  swiglu_backward(dh, g, u, dg, du);
  const auto hd = forward_ref(to_double(g), to_double(u));
  std::vector<double> dg_ref, du_ref;
  backward_ref(to_double(dh), to_double(g), to_double(u), dg_ref, du_ref);
  double worst = 0;
  for (int64_t i = 0; i < n; ++i) {
    const size_t k = static_cast<size_t>(i);
    const float got[3] = {h.data<float>()[i], dg.data<float>()[i], du.data<float>()[i]};
    const double want[3] = {hd[k], dg_ref[k], du_ref[k]};
    for (int j = 0; j < 3; ++j) {
      ASSERT_TRUE(std::isfinite(got[j])) << "z = " << zs[k] << " output " << j;
      // Where the true value is a normal f32 (|z| ≤ 80 here), it must be right to
      // a few ulps; beyond that the answer underflows to denormals/zero or is
      // ±|z|·u, and only finiteness and the absolute error matter.
      if (std::abs(want[j]) >= std::numeric_limits<float>::min() && std::abs(zs[k]) <= 80.0f) {
        const double rel = std::abs(got[j] - want[j]) / std::abs(want[j]);
        worst = std::max(worst, rel);
        EXPECT_LT(rel, 1e-5) << "z = " << zs[k] << " output " << j << " got " << got[j] << " want " << want[j];
      } else {
        EXPECT_LE(std::abs(got[j] - want[j]), 1e-6 * std::max(1.0, std::abs(want[j]))) << "z = " << zs[k];
      }
    }
  }
  std::printf("large |z|: worst element-wise relative error %.3g\n", worst);
}

// bf16 storage, f32 maths: the output is the f32 result rounded once to bf16.
TEST(SwiGLU, Bf16MatchesDoubleAndRoundedF32) {
  for (const Shape& s : kShapes) {
    const std::string name = shape_str(s);
    Tensor g = random_tensor(s, DType::bf16, "g" + name, 6.0f);
    Tensor u = random_tensor(s, DType::bf16, "u" + name, 2.0f);
    Tensor dh = random_tensor(s, DType::bf16, "dh" + name);
    Tensor h = empty_like(g, "h"), dg = empty_like(g, "dg"), du = empty_like(g, "du");
    swiglu_forward(g, u, h);
    swiglu_backward(dh, g, u, dg, du);

    // Against double on the same (bf16-valued) inputs. bf16 keeps 8 significant
    // bits, so rounding to nearest is off by at most 2^-8 ≈ 0.0039 relative per
    // value; inputs are exact and the f32 maths adds ~1e-7, and the single output
    // rounding does not accumulate, so the norm-relative error is below 2^-8
    // (≈ 0.0015 expected for random values).
    const double tol = std::ldexp(1.0, -8);
    std::vector<double> dg_ref, du_ref;
    backward_ref(to_double(dh), to_double(g), to_double(u), dg_ref, du_ref);
    const double eh = rel_error(h, forward_ref(to_double(g), to_double(u)));
    const double eg = rel_error(dg, dg_ref), eu = rel_error(du, du_ref);
    std::printf("bf16 %s rel_error h %.3g dg %.3g du %.3g\n", name.c_str(), eh, eg, eu);
    EXPECT_LT(eh, tol) << name;
    EXPECT_LT(eg, tol) << name;
    EXPECT_LT(eu, tol) << name;

    // Same f32 maths as the f32 kernel: bit for bit the rounded f32 result.
    Tensor gf = g.to(DType::f32, MemCategory::workspace, "gf"), uf = u.to(DType::f32, MemCategory::workspace, "uf");
    Tensor dhf = dh.to(DType::f32, MemCategory::workspace, "dhf");
    Tensor hf = empty_like(gf, "hf"), dgf = empty_like(gf, "dgf"), duf = empty_like(gf, "duf");
    swiglu_forward(gf, uf, hf);
    swiglu_backward(dhf, gf, uf, dgf, duf);
    for (int64_t i = 0; i < g.numel(); ++i) {
      ASSERT_EQ(h.data<bf16>()[i].bits, bf16::from_float(hf.data<float>()[i])) << name << " h[" << i << "]";
      ASSERT_EQ(dg.data<bf16>()[i].bits, bf16::from_float(dgf.data<float>()[i])) << name << " dg[" << i << "]";
      ASSERT_EQ(du.data<bf16>()[i].bits, bf16::from_float(duf.data<float>()[i])) << name << " du[" << i << "]";
    }
  }
}

// In place: the results must be bit-identical to the out-of-place ones.
TEST(SwiGLU, InPlaceMatchesOutOfPlace) {
  for (DType dt : {DType::f32, DType::bf16}) {
    const Shape s = {37, 129};
    Tensor g = random_tensor(s, dt, "ip_g", 6.0f), u = random_tensor(s, dt, "ip_u"), dh = random_tensor(s, dt, "ip_dh");
    Tensor h = empty_like(g, "h"), dg = empty_like(g, "dg"), du = empty_like(g, "du");
    swiglu_forward(g, u, h);
    swiglu_backward(dh, g, u, dg, du);
    auto copy = [](const Tensor& t) {
      Tensor c = Tensor::empty(t.shape(), t.dtype(), MemCategory::workspace, "copy");
      c.copy_from(t);
      return c;
    };
    auto same = [](const Tensor& a, const Tensor& b) { return std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0; };
    {  // h into g, and into u
      Tensor g2 = copy(g), u2 = copy(u);
      swiglu_forward(g2, u, g2);
      swiglu_forward(g, u2, u2);
      EXPECT_TRUE(same(g2, h) && same(u2, h)) << dtype_name(dt);
    }
    {  // dg into g, du into u
      Tensor g2 = copy(g), u2 = copy(u);
      swiglu_backward(dh, g2, u2, g2, u2);
      EXPECT_TRUE(same(g2, dg) && same(u2, du)) << dtype_name(dt);
    }
    {  // dg into dh, du into g
      Tensor dh2 = copy(dh), g2 = copy(g);
      swiglu_backward(dh2, g2, u, dh2, g2);
      EXPECT_TRUE(same(dh2, dg) && same(g2, du)) << dtype_name(dt);
    }
  }
}

TEST(SwiGLU, NaNPropagates) {
  for (DType dt : {DType::f32, DType::bf16}) {
    Tensor g = random_tensor({2, 20}, dt, "nan_g"), u = random_tensor({2, 20}, dt, "nan_u");
    Tensor gf = Tensor::empty(g.shape(), DType::f32, MemCategory::workspace, "gf");
    gf.copy_from(g);
    gf.data<float>()[3] = std::numeric_limits<float>::quiet_NaN();
    gf.data<float>()[25] = std::numeric_limits<float>::quiet_NaN();
    g.copy_from(gf);
    Tensor h = empty_like(g, "h"), dg = empty_like(g, "dg"), du = empty_like(g, "du");
    swiglu_forward(g, u, h);
    swiglu_backward(u, g, u, dg, du);
    for (int64_t i : {3, 25}) {
      EXPECT_TRUE(std::isnan(h.item_f32(i))) << dtype_name(dt);
      EXPECT_TRUE(std::isnan(dg.item_f32(i))) << dtype_name(dt);
      EXPECT_TRUE(std::isnan(du.item_f32(i))) << dtype_name(dt);
    }
    EXPECT_TRUE(std::isfinite(h.item_f32(4)));
  }
}

}  // namespace
