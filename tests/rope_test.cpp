// RoPE: frequencies (plain and Llama 3.1 scaled), the cos/sin table, and the
// forward/backward rotation against a naive double reference (halves
// convention), central finite differences, and bf16 storage.
#include "anvil/ops/rope.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>

#include "test_util.h"

namespace {
using namespace anvil;
using namespace anvil::testing;

// A 2×2 rotation per pair in f32 with an f32 table (cos/sin rounded once,
// ≤ 6e-8): errors ~1e-7 relative, so 1e-6 is tight.
constexpr double kF32Tol = 1e-6;
// bf16 keeps 8 significant bits: one rounding to nearest has relative error at
// most 2^-8 ≈ 3.9e-3 per element. The rotation is computed in f32 from exact
// bf16 inputs and rounded once.
constexpr double kBf16OneRounding = 4e-3;

struct Shape4 {
  int64_t B, T, H, D;
};

// y = rotation of x by pos·f_i (sign −1: the inverse), HALVES pairing (i, i + D/2).
std::vector<double> ref_rope(const std::vector<double>& x, Shape4 s, const std::vector<double>& f, int64_t offset,
                             double sign = 1) {
  std::vector<double> y(x.size());
  const int64_t half = s.D / 2;
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t t = 0; t < s.T; ++t)
      for (int64_t h = 0; h < s.H; ++h) {
        const int64_t base = ((b * s.T + t) * s.H + h) * s.D;
        for (int64_t i = 0; i < half; ++i) {
          const double a = static_cast<double>(offset + t) * f[i];
          const double c = std::cos(a), sn = sign * std::sin(a);
          const double x1 = x[base + i], x2 = x[base + half + i];
          y[base + i] = x1 * c - x2 * sn;
          y[base + half + i] = x2 * c + x1 * sn;
        }
      }
  return y;
}

std::vector<double> plain_freq(int64_t D, double theta) {
  std::vector<double> f(static_cast<size_t>(D / 2));
  for (int64_t i = 0; i < D / 2; ++i) f[i] = std::pow(theta, -2.0 * i / static_cast<double>(D));
  return f;
}

std::string tag(const char* what, Shape4 s) {
  return std::string(what) + "_" + std::to_string(s.B) + "_" + std::to_string(s.T) + "_" + std::to_string(s.H) + "_" +
         std::to_string(s.D);
}

Tensor rand4(Shape4 s, DType dt, const std::string& name) { return random_tensor({s.B, s.T, s.H, s.D}, dt, name); }
Tensor empty4(Shape4 s, DType dt) { return Tensor::empty({s.B, s.T, s.H, s.D}, dt, MemCategory::workspace, "out"); }

// head_dim 64 and 128, several heads, a single token, and half-dims that are not
// multiples of 16 (5, 17, 33) to exercise the masked tails.
const std::vector<Shape4> kShapes = {{1, 1, 1, 64}, {2, 5, 3, 128}, {1, 7, 4, 64}, {2, 3, 2, 10},
                                     {1, 4, 2, 34}, {3, 2, 5, 66},  {1, 1, 32, 128}};

TEST(RoPE, InvFreqUnscaledIsThetaPower) {
  for (auto [D, theta] : std::vector<std::pair<int64_t, double>>{{64, 1e4}, {128, 5e5}, {10, 1e4}}) {
    const std::vector<double> f = rope_inv_freq(D, theta);
    ASSERT_EQ(f.size(), static_cast<size_t>(D / 2));
    for (int64_t i = 0; i < D / 2; ++i)
      EXPECT_NEAR(f[i], std::pow(theta, -2.0 * i / static_cast<double>(D)), 1e-15 * f[i]) << i;
  }
}

// Hand-computed, D = 8, theta = 1e4: f = 1, 0.1, 0.01, 0.001, wavelengths 2π/f =
// 6.28, 62.8, 628.3, 6283. With original 1000, high_freq_factor 4 (short
// boundary 250) and low_freq_factor 1 (long boundary 1000), factor 8:
//   f=1, 0.1   : λ < 250, kept
//   f=0.001    : λ > 1000, 0.001/8 = 1.25e-4
//   f=0.01     : middle, s = (1000/628.3185 − 1)/3 = (1.5915494 − 1)/3 = 0.1971831,
//                (1 − s)·0.01/8 + s·0.01 = 0.0010035211 + 0.0019718314 = 0.0029753525
TEST(RoPE, ScalingRegimesSmallCase) {
  RopeScaling sc{.enabled = true, .factor = 8, .low_freq_factor = 1, .high_freq_factor = 4,
                 .original_max_position = 1000};
  const std::vector<double> f = rope_inv_freq(8, 1e4, sc);
  EXPECT_NEAR(f[0], 1.0, 1e-15);
  EXPECT_NEAR(f[1], 0.1, 1e-16);
  EXPECT_NEAR(f[2], 0.0029753525068469, 1e-15);
  EXPECT_NEAR(f[3], 1.25e-4, 1e-18);
}

// Llama 3.1 (theta 5e5, D 128, defaults: factor 8, low 1, high 4, original
// 8192: short boundary 2048, long boundary 8192). f_i = 5e5^(−i/64):
//   i = 28: f = 3.2114460e-3, λ = 1956.5 < 2048: kept
//   i = 29: f = 2.6160993e-3, λ = 2401.7: s = (8192/2401.7 − 1)/3 = 0.8036210 →
//           f·((1−s)/8 + s) = 2.1665708e-3
//   i = 30: f = 2.1311195e-3, λ = 2948.3: s = 0.5928493 → 1.3718936e-3
//   i = 34: f = 9.3847387e-4, λ = 6695.1: s = 0.0745266 → 1.7850781e-4
//   i = 35: f = 7.6449699e-4, λ = 8218.7 > 8192: f/8 = 9.5562124e-5
//   i = 63: f = 2.4551408e-6: f/8 = 3.0689260e-7
TEST(RoPE, ScalingRegimesLlama31) {
  const std::vector<double> f = rope_inv_freq(128, 5e5, RopeScaling{.enabled = true});
  const std::vector<double> plain = rope_inv_freq(128, 5e5);
  auto near = [](double got, double want) { EXPECT_NEAR(got, want, 1e-7 * want); };
  near(f[0], 1.0);
  near(f[28], 3.2114460e-3);
  near(f[29], 2.1665708e-3);
  near(f[30], 1.3718936e-3);
  near(f[34], 1.7850781e-4);
  near(f[35], 9.5562124e-5);
  near(f[63], 3.0689260e-7);
  for (int i = 0; i <= 28; ++i) EXPECT_EQ(f[i], plain[i]) << i;  // the whole high band is untouched
  for (int i = 35; i < 64; ++i) EXPECT_NEAR(f[i], plain[i] / 8, 1e-16 * plain[i]) << i;
}

TEST(RoPE, BadConfigThrows) {
  EXPECT_THROW(rope_inv_freq(7, 1e4), Error);  // odd head_dim
  EXPECT_THROW(rope_inv_freq(64, 1e4, RopeScaling{.enabled = true, .low_freq_factor = 4, .high_freq_factor = 1}),
               Error);
}

TEST(RoPE, TableIsCosSinOfPositionTimesFrequency) {
  const int64_t T = 300;
  for (bool scaled : {false, true}) {
    for (auto [D, theta] : std::vector<std::pair<int64_t, double>>{{64, 1e4}, {128, 5e5}}) {
      const RopeScaling sc{.enabled = scaled};
      const RopeTable tab = rope_table(T, D, theta, sc);
      ASSERT_EQ(tab.max_positions(), T);
      ASSERT_EQ(tab.head_dim(), D);
      // Unscaled: the frequencies are exactly theta^(−2i/D), computed here afresh.
      const std::vector<double> f = scaled ? rope_inv_freq(D, theta, sc) : plain_freq(D, theta);
      double worst = 0;
      for (int64_t p = 0; p < T; ++p)
        for (int64_t i = 0; i < D / 2; ++i) {
          worst = std::max(worst, std::abs(tab.cos.item_f32(p * D / 2 + i) - std::cos(p * f[i])));
          worst = std::max(worst, std::abs(tab.sin.item_f32(p * D / 2 + i) - std::sin(p * f[i])));
        }
      // f32 storage of a value in [−1, 1]: at most 2^-25 ≈ 3e-8 off, absolute.
      EXPECT_LT(worst, 3.1e-8) << D << (scaled ? " scaled" : "");
    }
  }
}

TEST(RoPE, ForwardF32MatchesDouble) {
  const RopeTable tab64 = rope_table(64, 64, 1e4), tab128 = rope_table(64, 128, 5e5);
  for (Shape4 s : kShapes) {
    const RopeTable tab = s.D == 64 ? tab64 : s.D == 128 ? tab128 : rope_table(64, s.D, 1e4);
    const std::vector<double> f = plain_freq(s.D, s.D == 128 ? 5e5 : 1e4);
    for (int64_t offset : {0, 13}) {
      Tensor x = rand4(s, DType::f32, tag("x", s));
      Tensor y = empty4(s, DType::f32);
      rope_forward(x, tab, offset, y);
      const double e = rel_error(y, ref_rope(to_double(x), s, f, offset));
      std::printf("f32 forward B=%ld T=%ld H=%ld D=%ld offset=%ld: rel err %.2e\n", s.B, s.T, s.H, s.D, offset, e);
      EXPECT_LT(e, kF32Tol);
      // In place gives the same values, bit for bit.
      rope_forward(x, tab, offset, x);
      EXPECT_EQ(to_double(x), to_double(y));
    }
  }
}

TEST(RoPE, ForwardWithScaledTable) {
  const Shape4 s{2, 9, 3, 128};
  const RopeScaling sc{.enabled = true};
  const RopeTable tab = rope_table(16, 128, 5e5, sc);
  Tensor x = rand4(s, DType::f32, "scaled_x");
  Tensor y = empty4(s, DType::f32);
  rope_forward(x, tab, 5, y);
  EXPECT_LT(rel_error(y, ref_rope(to_double(x), s, rope_inv_freq(128, 5e5, sc), 5)), kF32Tol);
}

TEST(RoPE, BackwardF32MatchesDouble) {
  for (Shape4 s : kShapes) {
    const RopeTable tab = rope_table(40, s.D, 1e4);
    Tensor dy = rand4(s, DType::f32, tag("dy", s));
    Tensor dx = empty4(s, DType::f32);
    rope_backward(dy, tab, 7, dx);
    const double e = rel_error(dx, ref_rope(to_double(dy), s, plain_freq(s.D, 1e4), 7, -1));
    std::printf("f32 backward B=%ld T=%ld H=%ld D=%ld: rel err %.2e\n", s.B, s.T, s.H, s.D, e);
    EXPECT_LT(e, kF32Tol);
  }
}

TEST(RoPE, BackwardMatchesFiniteDifferences) {
  for (Shape4 s : std::vector<Shape4>{{1, 3, 2, 6}, {2, 2, 1, 4}}) {
    const RopeTable tab = rope_table(8, s.D, 1e4);
    const std::vector<double> f = plain_freq(s.D, 1e4);
    Tensor x = rand4(s, DType::f32, tag("fd_x", s));
    Tensor g = rand4(s, DType::f32, tag("fd_g", s));  // loss = Σ y·g, so dy = g
    const std::vector<double> gd = to_double(g);
    const auto num = numerical_grad(
        [&](const std::vector<double>& v) { return weighted_sum(ref_rope(v, s, f, 2), gd); }, to_double(x));
    Tensor dx = empty4(s, DType::f32);
    rope_backward(g, tab, 2, dx);
    const double e = rel_error(dx, num);
    std::printf("finite differences B=%ld T=%ld H=%ld D=%ld: rel err %.2e\n", s.B, s.T, s.H, s.D, e);
    EXPECT_LT(e, kF32Tol);
  }
}

TEST(RoPE, BackwardOfForwardIsIdentity) {
  const Shape4 s{2, 33, 4, 128};
  const RopeTable tab = rope_table(4096, 128, 5e5);
  for (DType dt : {DType::f32, DType::bf16}) {
    Tensor x = rand4(s, dt, "id_x");
    Tensor y = empty4(s, dt), z = empty4(s, dt);
    rope_forward(x, tab, 4000, y);
    rope_backward(y, tab, 4000, z);
    const double e = rel_error(z, to_double(x));
    std::printf("%s backward(forward(x)) vs x: rel err %.2e\n", dtype_name(dt), e);
    // bf16: two roundings (y, then z), each at most 2^-8 relative.
    EXPECT_LT(e, dt == DType::f32 ? kF32Tol : 2 * kBf16OneRounding);
  }
}

TEST(RoPE, Bf16MatchesDouble) {
  for (Shape4 s : kShapes) {
    const RopeTable tab = rope_table(64, s.D, 1e4);
    const std::vector<double> f = plain_freq(s.D, 1e4);
    Tensor x = rand4(s, DType::bf16, tag("x16", s));
    Tensor y = empty4(s, DType::bf16), dx = empty4(s, DType::bf16);
    rope_forward(x, tab, 3, y);
    rope_backward(x, tab, 3, dx);
    const std::vector<double> xd = to_double(x);  // exactly what the kernel sees
    const double ef = rel_error(y, ref_rope(xd, s, f, 3)), eb = rel_error(dx, ref_rope(xd, s, f, 3, -1));
    std::printf("bf16 B=%ld T=%ld H=%ld D=%ld: forward rel err %.2e, backward %.2e\n", s.B, s.T, s.H, s.D, ef, eb);
    EXPECT_LT(ef, kBf16OneRounding);
    EXPECT_LT(eb, kBf16OneRounding);
  }
}

TEST(RoPE, PositionsOutsideTheTableThrow) {
  const RopeTable tab = rope_table(10, 8, 1e4);
  Tensor x = rand4({1, 4, 1, 8}, DType::f32, "oob_x");
  Tensor y = empty4({1, 4, 1, 8}, DType::f32);
  EXPECT_NO_THROW(rope_forward(x, tab, 6, y));  // positions 6..9: the last rows
  EXPECT_THROW(rope_forward(x, tab, 7, y), Error);
  EXPECT_THROW(rope_backward(x, tab, 7, y), Error);
  EXPECT_THROW(rope_forward(x, tab, -1, y), Error);
}

}  // namespace
