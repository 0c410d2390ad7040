#include "anvil/ops/adamw.h"

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

// ---- double-precision reference: torch.optim.AdamW written out ----
struct RefState {
  std::vector<double> p, m, v;
};
void adamw_ref(const AdamWConfig& c, int64_t t, RefState& s, const std::vector<double>& g) {
  const double lr = c.lr, b1 = c.beta1, b2 = c.beta2, eps = c.eps, wd = c.weight_decay;
  const double bc1 = 1 - std::pow(b1, static_cast<double>(t)), bc2 = 1 - std::pow(b2, static_cast<double>(t));
  for (size_t i = 0; i < g.size(); ++i) {
    s.p[i] -= lr * wd * s.p[i];
    s.m[i] = b1 * s.m[i] + (1 - b1) * g[i];
    s.v[i] = b2 * s.v[i] + (1 - b2) * g[i] * g[i];
    const double mhat = s.m[i] / bc1, vhat = s.v[i] / bc2;
    s.p[i] -= lr * mhat / (std::sqrt(vhat) + eps);
  }
}

Tensor f32_zeros(int64_t n, const char* tag) { return Tensor::zeros({n}, DType::f32, MemCategory::optimizer_state, tag); }
Tensor copy_of(const Tensor& t) {
  Tensor c = Tensor::empty(t.shape(), t.dtype(), MemCategory::workspace, "copy");
  c.copy_from(t);
  return c;
}
bool same_bits(const Tensor& a, const Tensor& b) { return std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0; }

// Sizes: one element, not a multiple of 16 lanes, and big enough for two threads.
const std::vector<int64_t> kSizes = {1, 17, 1000, 100003};

// Five steps with a different gradient each time (and a different scale, so
// the ratio m̂/sqrt(v̂) is not simply ±1), against the double reference.
TEST(AdamW, FiveStepsMatchDouble) {
  for (float wd : {0.0f, 0.1f}) {
    for (int64_t n : kSizes) {
      AdamWConfig cfg{.lr = 1e-2f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = wd};
      Tensor p = random_tensor({n}, DType::f32, detail::concat("p", n));
      Tensor m = f32_zeros(n, "m"), v = f32_zeros(n, "v");
      const std::vector<double> p0 = to_double(p);
      RefState ref{p0, std::vector<double>(static_cast<size_t>(n), 0.0), std::vector<double>(static_cast<size_t>(n), 0.0)};
      for (int64_t t = 1; t <= 5; ++t) {
        const float scale = 0.1f * static_cast<float>(t * t);
        Tensor g = random_tensor({n}, DType::f32, detail::concat("g", n, "_", t), scale);
        adamw_step(cfg, t, p, g, m, v);
        adamw_ref(cfg, t, ref, to_double(g));
      }
      // Displacement p − p0: the part the optimizer computes, so an error in the
      // update is not diluted by the size of p. Each step rounds p to f32
      // (≤ 2^-24 relative to |p| ≤ 1, against updates of ≈ lr = 1e-2), so ≈ 1e-6.
      std::vector<double> got_d = to_double(p), want_d = ref.p;
      for (size_t i = 0; i < got_d.size(); ++i) got_d[i] -= p0[i], want_d[i] -= p0[i];
      const double ep = rel_error(p, ref.p), ed = rel_error(got_d, want_d);
      const double em = rel_error(m, ref.m), ev = rel_error(v, ref.v);
      std::printf("wd %.1f n %lld: rel_error p %.3g (p - p0) %.3g m %.3g v %.3g\n", wd, static_cast<long long>(n), ep,
                  ed, em, ev);
      EXPECT_LT(ep, 1e-6);
      EXPECT_LT(ed, 1e-5);
      // m and v: a few multiply-adds in f32 per step.
      EXPECT_LT(em, 1e-6);
      EXPECT_LT(ev, 1e-6);
    }
  }
}

// At t = 1, m̂ = g and v̂ = g², so the update is lr·g/(|g| + eps) ≈ lr·sign(g)
// whatever the gradient's scale: that is what the bias correction is for.
TEST(AdamW, FirstStepHasMagnitudeLr) {
  const int64_t n = 1001;
  const AdamWConfig cfg{.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.0f};
  for (float scale : {1e-4f, 1.0f, 1e4f}) {
    Tensor p = random_tensor({n}, DType::f32, "p1", 0.1f);
    Tensor r = random_tensor({n}, DType::f32, "r1");
    // |g| in [scale/2, scale]: eps/|g| ≤ 2e-4 even for the smallest scale.
    Tensor g = Tensor::empty({n}, DType::f32, MemCategory::gradients, "g1");
    for (int64_t i = 0; i < n; ++i) {
      const float x = r.data<float>()[i];
      g.data<float>()[i] = std::copysign(scale * (0.5f + 0.5f * std::abs(x)), x);
    }
    Tensor m = f32_zeros(n, "m"), v = f32_zeros(n, "v");
    const std::vector<double> p0 = to_double(p);
    adamw_step(cfg, 1, p, g, m, v);
    double worst = 0;
    for (int64_t i = 0; i < n; ++i) {
      const double step = p.data<float>()[i] - p0[static_cast<size_t>(i)];
      const double want = -cfg.lr * std::copysign(1.0, g.data<float>()[i]);
      worst = std::max(worst, std::abs(step - want) / cfg.lr);
    }
    std::printf("grad scale %g: first update = lr·sign(g) within %.3g·lr\n", scale, worst);
    // eps/|g| ≤ 2e-4, plus f32 rounding of p (|p| ≤ 0.1: ≤ 4e-9 = 4e-6·lr).
    EXPECT_LT(worst, 1e-3) << "scale " << scale;
  }
}

// With β1 = β2 = 0, m̂ = g and v̂ = g² at any step, so a step has a closed
// form: p·(1 − lr·wd) − lr·g/(|g| + eps). The decay multiplies p directly and
// does not pass through m and v (as L2 regularisation inside Adam would).
TEST(AdamW, DecayIsDecoupled) {
  const int64_t n = 33;
  const AdamWConfig cfg{.lr = 0.1f, .beta1 = 0.0f, .beta2 = 0.0f, .eps = 1e-8f, .weight_decay = 0.5f};
  Tensor p = random_tensor({n}, DType::f32, "pd"), g = random_tensor({n}, DType::f32, "gd", 100.0f);
  Tensor m = f32_zeros(n, "m"), v = f32_zeros(n, "v");
  const std::vector<double> p0 = to_double(p);
  adamw_step(cfg, 3, p, g, m, v);
  for (int64_t i = 0; i < n; ++i) {
    const double gi = g.data<float>()[i];
    // p·(1 − lr·wd) − lr·g/(|g| + eps): the decay does not go through m, v.
    const double want = p0[static_cast<size_t>(i)] * (1 - 0.1 * 0.5) - 0.1 * gi / (std::abs(gi) + 1e-8);
    EXPECT_NEAR(p.data<float>()[i], want, 1e-6) << i;
  }
}

// The bf16 compute copy written in the same pass is exactly bf16(p) rounded to
// nearest even, and writing it changes nothing else.
TEST(AdamW, Bf16CopyIsRoundedMaster) {
  for (int64_t n : kSizes) {
    const AdamWConfig cfg{.lr = 3e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f};
    Tensor p = random_tensor({n}, DType::f32, "pb"), m = random_tensor({n}, DType::f32, "mb", 0.01f);
    Tensor v = random_tensor({n}, DType::f32, "vb", 1e-4f);
    for (int64_t i = 0; i < n; ++i) v.data<float>()[i] = std::abs(v.data<float>()[i]);  // v ≥ 0
    Tensor g = random_tensor({n}, DType::f32, "gb", 0.01f);
    Tensor p2 = copy_of(p), m2 = copy_of(m), v2 = copy_of(v);
    Tensor pb = Tensor::empty({n}, DType::bf16, MemCategory::parameters, "p_bf16");
    adamw_step(cfg, 7, p, g, m, v, &pb);
    adamw_step(cfg, 7, p2, g, m2, v2);
    EXPECT_TRUE(same_bits(p, p2) && same_bits(m, m2) && same_bits(v, v2)) << n;
    for (int64_t i = 0; i < n; ++i)
      ASSERT_EQ(pb.data<bf16>()[i].bits, bf16::from_float(p.data<float>()[i])) << "n " << n << " i " << i;
  }
}

// grad_scale applied on the fly is bit for bit the same as scaling g first.
TEST(AdamW, GradScaleEqualsPrescaledGradient) {
  for (int64_t n : kSizes) {
    const AdamWConfig cfg{.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.95f, .eps = 1e-8f, .weight_decay = 0.1f};
    const float s = 0.3173f;
    Tensor p = random_tensor({n}, DType::f32, "ps"), g = random_tensor({n}, DType::f32, "gs", 5.0f);
    Tensor m = f32_zeros(n, "m"), v = f32_zeros(n, "v");
    Tensor p2 = copy_of(p), m2 = copy_of(m), v2 = copy_of(v), gs = copy_of(g);
    for (int64_t i = 0; i < n; ++i) gs.data<float>()[i] *= s;
    for (int64_t t = 1; t <= 3; ++t) {
      adamw_step(cfg, t, p, g, m, v, nullptr, s);
      adamw_step(cfg, t, p2, gs, m2, v2);
    }
    EXPECT_TRUE(same_bits(p, p2)) << n;
    EXPECT_TRUE(same_bits(m, m2)) << n;
    EXPECT_TRUE(same_bits(v, v2)) << n;
  }
}

TEST(AdamW, RejectsBadSettings) {
  const int64_t n = 4;
  Tensor p = random_tensor({n}, DType::f32, "pe"), g = random_tensor({n}, DType::f32, "ge");
  Tensor m = f32_zeros(n, "m"), v = f32_zeros(n, "v");
  const AdamWConfig ok;
  auto with = [&](auto change) {
    AdamWConfig c = ok;
    change(c);
    return c;
  };
  EXPECT_THROW(adamw_step(with([](AdamWConfig& c) { c.lr = -1e-3f; }), 1, p, g, m, v), Error);
  EXPECT_THROW(adamw_step(with([](AdamWConfig& c) { c.beta1 = 1.0f; }), 1, p, g, m, v), Error);
  EXPECT_THROW(adamw_step(with([](AdamWConfig& c) { c.beta2 = -0.1f; }), 1, p, g, m, v), Error);
  EXPECT_THROW(adamw_step(with([](AdamWConfig& c) { c.eps = 0.0f; }), 1, p, g, m, v), Error);
  EXPECT_THROW(adamw_step(with([](AdamWConfig& c) { c.weight_decay = std::nanf(""); }), 1, p, g, m, v), Error);
  EXPECT_THROW(adamw_step(ok, 0, p, g, m, v), Error);
  EXPECT_THROW(adamw_step(ok, 1, p, g, m, v, nullptr, std::numeric_limits<float>::quiet_NaN()), Error);
  try {
    adamw_step(ok, 0, p, g, m, v);
  } catch (const Error& e) {
    std::printf("message: %s\n", e.what());
  }
}

}  // namespace
