// RMSNorm forward and backward against a naive double reference and central
// finite differences; bf16 storage against the double reference.
#include "anvil/ops/rmsnorm.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>

#include "test_util.h"

namespace {
using namespace anvil;
using namespace anvil::testing;

constexpr float kEps = 1e-5f;
// bf16 keeps 8 significant bits (7 stored + the implicit one), so one rounding
// to nearest has relative error at most 2^-8 ≈ 3.9e-3 per element (for a value
// just above a power of two; 2^-9 just below the next one), hence at most that
// in the norm-relative measure. Outputs below are computed in f32 from exact
// bf16 inputs and rounded once, so 4e-3 bounds them (measured: ~1.7e-3 on large
// shapes, up to 3.2e-3 on a 7-element row).
constexpr double kBf16OneRounding = 4e-3;
// f32 arithmetic against double: sums of D squares and of D products in f32
// (relative error ~ sqrt(D)·6e-8 in practice), well inside 1e-5.
constexpr double kF32Tol = 1e-5;

struct Ref {
  std::vector<double> y, rstd;
};

Ref ref_forward(const std::vector<double>& x, const std::vector<double>& w, int64_t M, int64_t D) {
  Ref r{std::vector<double>(x.size()), std::vector<double>(static_cast<size_t>(M))};
  for (int64_t m = 0; m < M; ++m) {
    double ss = 0;
    for (int64_t j = 0; j < D; ++j) ss += x[m * D + j] * x[m * D + j];
    const double rs = 1.0 / std::sqrt(ss / static_cast<double>(D) + kEps);
    r.rstd[m] = rs;
    for (int64_t j = 0; j < D; ++j) r.y[m * D + j] = x[m * D + j] * rs * w[j];
  }
  return r;
}

struct RefGrad {
  std::vector<double> dx, dw;
};

RefGrad ref_backward(const std::vector<double>& dy, const std::vector<double>& x, const std::vector<double>& w,
                     int64_t M, int64_t D) {
  RefGrad g{std::vector<double>(x.size()), std::vector<double>(static_cast<size_t>(D), 0.0)};
  const Ref f = ref_forward(x, w, M, D);
  for (int64_t m = 0; m < M; ++m) {
    const double r = f.rstd[m];
    double dot = 0;
    for (int64_t j = 0; j < D; ++j) dot += dy[m * D + j] * w[j] * x[m * D + j];
    for (int64_t j = 0; j < D; ++j) {
      g.dx[m * D + j] = r * dy[m * D + j] * w[j] - r * r * r / static_cast<double>(D) * dot * x[m * D + j];
      g.dw[j] += dy[m * D + j] * x[m * D + j] * r;
    }
  }
  return g;
}

std::vector<double> add(const std::vector<double>& a, const std::vector<double>& b, double scale = 1) {
  std::vector<double> c(a.size());
  for (size_t i = 0; i < a.size(); ++i) c[i] = a[i] + scale * b[i];
  return c;
}

std::string tag(const char* what, int64_t M, int64_t D) {
  return std::string(what) + "_" + std::to_string(M) + "x" + std::to_string(D);
}

// Shapes: a single row, tiny, D not a multiple of 16, several chunks of the dw
// reduction (600 rows at D = 2048 is three chunks of 256).
const std::vector<std::pair<int64_t, int64_t>> kShapes = {{1, 7}, {3, 5}, {17, 100}, {5, 33}, {64, 2048}, {600, 2048}};

TEST(RMSNorm, ForwardF32MatchesDouble) {
  for (auto [M, D] : kShapes) {
    Tensor x = random_tensor({M, D}, DType::f32, tag("x", M, D));
    Tensor w = random_tensor({D}, DType::f32, tag("w", M, D));
    Tensor y = Tensor::empty({M, D}, DType::f32, MemCategory::workspace, "y");
    Tensor rstd = Tensor::empty({M}, DType::f32, MemCategory::workspace, "rstd");
    rmsnorm_forward(x, w, kEps, y, rstd);
    const Ref ref = ref_forward(to_double(x), to_double(w), M, D);
    const double ey = rel_error(y, ref.y), er = rel_error(rstd, ref.rstd);
    std::printf("f32 forward M=%ld D=%ld: y rel err %.2e, rstd rel err %.2e\n", M, D, ey, er);
    EXPECT_LT(ey, kF32Tol) << M << "x" << D;
    EXPECT_LT(er, kF32Tol) << M << "x" << D;

    // Without rstd: the same output, bit for bit.
    Tensor y2 = Tensor::empty({M, D}, DType::f32, MemCategory::workspace, "y2");
    rmsnorm_forward(x, w, kEps, y2);
    EXPECT_EQ(to_double(y2), to_double(y));
  }
}

TEST(RMSNorm, ForwardTakesLeadingDims) {
  const int64_t B = 2, T = 3, D = 40;
  Tensor x = random_tensor({B, T, D}, DType::f32, "x3");
  Tensor w = random_tensor({D}, DType::f32, "w3");
  Tensor y = Tensor::empty({B, T, D}, DType::f32, MemCategory::workspace, "y");
  rmsnorm_forward(x, w, kEps, y);
  EXPECT_LT(rel_error(y, ref_forward(to_double(x), to_double(w), B * T, D).y), kF32Tol);
}

TEST(RMSNorm, BackwardF32MatchesDouble) {
  for (auto [M, D] : kShapes) {
    for (bool saved : {true, false}) {
      Tensor x = random_tensor({M, D}, DType::f32, tag("x", M, D));
      Tensor w = random_tensor({D}, DType::f32, tag("w", M, D));
      Tensor dy = random_tensor({M, D}, DType::f32, tag("dy", M, D));
      Tensor y = Tensor::empty({M, D}, DType::f32, MemCategory::workspace, "y");
      Tensor rstd = Tensor::empty({M}, DType::f32, MemCategory::workspace, "rstd");
      rmsnorm_forward(x, w, kEps, y, rstd);
      Tensor dx = Tensor::empty({M, D}, DType::f32, MemCategory::workspace, "dx");
      Tensor dw = random_tensor({D}, DType::f32, tag("dw0", M, D));  // dw accumulates onto this
      const std::vector<double> dw0 = to_double(dw);
      rmsnorm_backward(dy, x, w, saved ? rstd : Tensor(), kEps, dx, dw);
      const RefGrad ref = ref_backward(to_double(dy), to_double(x), to_double(w), M, D);
      const double edx = rel_error(dx, ref.dx), edw = rel_error(add(to_double(dw), dw0, -1), ref.dw);
      std::printf("f32 backward M=%ld D=%ld rstd %s: dx rel err %.2e, dw rel err %.2e\n", M, D,
                  saved ? "saved" : "recomputed", edx, edw);
      EXPECT_LT(edx, kF32Tol) << M << "x" << D;
      EXPECT_LT(edw, kF32Tol) << M << "x" << D;
    }
  }
}

TEST(RMSNorm, BackwardMatchesFiniteDifferences) {
  for (auto [M, D] : std::vector<std::pair<int64_t, int64_t>>{{3, 5}, {2, 19}, {1, 3}}) {
    Tensor x = random_tensor({M, D}, DType::f32, tag("fd_x", M, D));
    Tensor w = random_tensor({D}, DType::f32, tag("fd_w", M, D));
    Tensor g = random_tensor({M, D}, DType::f32, tag("fd_g", M, D));  // loss = Σ y·g, so dy = g
    const std::vector<double> xd = to_double(x), wd = to_double(w), gd = to_double(g);
    const auto num_dx = numerical_grad([&](const std::vector<double>& v) {
      return weighted_sum(ref_forward(v, wd, M, D).y, gd);
    }, xd);
    const auto num_dw = numerical_grad([&](const std::vector<double>& v) {
      return weighted_sum(ref_forward(xd, v, M, D).y, gd);
    }, wd);
    Tensor dx = Tensor::empty({M, D}, DType::f32, MemCategory::workspace, "dx");
    Tensor dw = Tensor::zeros({D}, DType::f32, MemCategory::workspace, "dw");
    rmsnorm_backward(g, x, w, Tensor(), kEps, dx, dw);
    const double edx = rel_error(dx, num_dx), edw = rel_error(dw, num_dw);
    std::printf("finite differences M=%ld D=%ld: dx rel err %.2e, dw rel err %.2e\n", M, D, edx, edw);
    EXPECT_LT(edx, kF32Tol);
    EXPECT_LT(edw, kF32Tol);
  }
}

TEST(RMSNorm, GradientsAccumulate) {
  const int64_t M = 37, D = 50;
  Tensor x = random_tensor({M, D}, DType::f32, "acc_x");
  Tensor w = random_tensor({D}, DType::f32, "acc_w");
  Tensor dy = random_tensor({M, D}, DType::f32, "acc_dy");
  Tensor dw = random_tensor({D}, DType::f32, "acc_dw0");
  Tensor dx = random_tensor({M, D}, DType::f32, "acc_dx0");
  const std::vector<double> dw0 = to_double(dw), dx0 = to_double(dx);
  const RefGrad ref = ref_backward(to_double(dy), to_double(x), to_double(w), M, D);

  // dw: two calls add twice.
  Tensor dx_w = Tensor::empty({M, D}, DType::f32, MemCategory::workspace, "dx_w");
  rmsnorm_backward(dy, x, w, Tensor(), kEps, dx_w, dw);
  rmsnorm_backward(dy, x, w, Tensor(), kEps, dx_w, dw);
  EXPECT_LT(rel_error(add(to_double(dw), dw0, -1), add(ref.dw, ref.dw)), kF32Tol);
  // dx: overwritten by default (checked above), added to with accumulate_dx.
  Tensor dw_scratch = Tensor::zeros({D}, DType::f32, MemCategory::workspace, "dw_scratch");
  rmsnorm_backward(dy, x, w, Tensor(), kEps, dx, dw_scratch, /*accumulate_dx=*/true);
  EXPECT_LT(rel_error(dx, add(dx0, ref.dx)), kF32Tol);
}

TEST(RMSNorm, Bf16MatchesDouble) {
  for (auto [M, D] : kShapes) {
    Tensor x = random_tensor({M, D}, DType::bf16, tag("x", M, D));
    Tensor w = random_tensor({D}, DType::bf16, tag("w", M, D));
    Tensor dy = random_tensor({M, D}, DType::bf16, tag("dy", M, D));
    // The reference sees exactly the bf16 values the kernel sees.
    const std::vector<double> xd = to_double(x), wd = to_double(w), dyd = to_double(dy);
    const Ref ref = ref_forward(xd, wd, M, D);
    const RefGrad refg = ref_backward(dyd, xd, wd, M, D);

    Tensor y = Tensor::empty({M, D}, DType::bf16, MemCategory::workspace, "y");
    Tensor rstd = Tensor::empty({M}, DType::f32, MemCategory::workspace, "rstd");
    rmsnorm_forward(x, w, kEps, y, rstd);
    Tensor dx = Tensor::empty({M, D}, DType::bf16, MemCategory::workspace, "dx");
    Tensor dw32 = Tensor::zeros({D}, DType::f32, MemCategory::workspace, "dw32");
    rmsnorm_backward(dy, x, w, rstd, kEps, dx, dw32);
    Tensor dx2 = Tensor::empty({M, D}, DType::bf16, MemCategory::workspace, "dx2");
    Tensor dw16 = Tensor::zeros({D}, DType::bf16, MemCategory::workspace, "dw16");
    rmsnorm_backward(dy, x, w, Tensor(), kEps, dx2, dw16);

    const double ey = rel_error(y, ref.y), er = rel_error(rstd, ref.rstd), edx = rel_error(dx, refg.dx),
                 edx2 = rel_error(dx2, refg.dx), edw32 = rel_error(dw32, refg.dw), edw16 = rel_error(dw16, refg.dw);
    std::printf("bf16 M=%ld D=%ld: y %.2e rstd %.2e dx %.2e (recomputed rstd %.2e) dw f32 %.2e dw bf16 %.2e\n", M,
                D, ey, er, edx, edx2, edw32, edw16);
    EXPECT_LT(ey, kBf16OneRounding);  // y rounded once to bf16
    EXPECT_LT(edx, kBf16OneRounding);  // dx rounded once to bf16
    EXPECT_LT(edx2, kBf16OneRounding);
    EXPECT_LT(edw16, kBf16OneRounding);  // f32 partial sums, rounded once when added into bf16 zeros
    // rstd and an f32 dw never touch bf16 rounding: the inputs are exact, the
    // arithmetic is f32, so the f32 tolerance holds.
    EXPECT_LT(er, kF32Tol);
    EXPECT_LT(edw32, kF32Tol);
  }
}

}  // namespace
