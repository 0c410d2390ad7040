// Dropless dispatch of tokens to experts and the weighted combine
// (ops/moe_dispatch.h): the routes' order by hand; both ops, the combine into
// a residual, both backwards and expert parallelism's row reordering
// (gather_rows, scatter_rows) element by element against a double reference
// in f32 and bf16, within bounds derived from the roundings each output goes
// through; and the routing where every token picks one expert.
#include "anvil/ops/moe_dispatch.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "test_util.h"

namespace {

using namespace anvil;
using namespace anvil::testing;

Tensor experts_of(const std::vector<int32_t>& e, int64_t M, int64_t k) {
  Tensor t = Tensor::empty({M, k}, DType::i32, MemCategory::workspace, "experts");
  std::copy(e.begin(), e.end(), t.data<int32_t>());
  return t;
}

std::vector<int32_t> values(const Tensor& t) { return {t.data<int32_t>(), t.data<int32_t>() + t.numel()}; }

// Routes (token, expert): 0:(0,2) 1:(0,0) 2:(1,0) 3:(1,1) 4:(2,2) 5:(2,1), over 4 experts.
TEST(MoeDispatch, RoutesSortByExpertKeepingTokenOrder) {
  const ExpertRoutes r = sort_routes(experts_of({2, 0, 0, 1, 2, 1}, 3, 2), 4);
  EXPECT_EQ(r.offsets, (std::vector<int64_t>{0, 2, 4, 6, 6}));  // expert 3 gets none
  EXPECT_EQ(values(r.order), (std::vector<int32_t>{1, 2, 3, 5, 0, 4}));
  EXPECT_EQ(values(r.row_of), (std::vector<int32_t>{4, 0, 1, 2, 5, 3}));
  EXPECT_EQ(r.rows(3), 0);
}

// Dropless: every token on expert 0 (top-1) is one run of all M rows, in token order.
TEST(MoeDispatch, EveryTokenOnOneExpertIsKept) {
  const int64_t M = 9, D = 4;
  const ExpertRoutes r = sort_routes(experts_of(std::vector<int32_t>(M, 0), M, 1), 8);
  EXPECT_EQ(r.rows(0), M);
  const Tensor x = random_tensor({M, D}, DType::f32, "x");
  Tensor xe = Tensor::empty({M, D}, DType::f32, MemCategory::workspace, "xe");
  dispatch_forward(x, r, xe);
  EXPECT_EQ(max_abs_error(to_double(xe), to_double(x)), 0.0);
}

// A random routing of 23 tokens, top-3 of 5 experts (distinct per token).
ExpertRoutes random_routes(int64_t M, int64_t k, int64_t E) {
  std::vector<int32_t> e;
  for (int64_t t = 0; t < M; ++t)
    for (int64_t j = 0; j < k; ++j) e.push_back(static_cast<int32_t>((t * 7 + j * 2 + t / 3) % E));
  return sort_routes(experts_of(e, M, k), E);
}

// Every element within its own bound, |got[i] − want[i]| <= bound[i] (a NaN is out of every bound); the first few
// that are not are named.
void expect_elementwise_within(const std::vector<double>& got, const std::vector<double>& want,
                               const std::vector<double>& bound, const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  ASSERT_EQ(bound.size(), want.size()) << what;
  int64_t failures = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::abs(got[i] - want[i]) <= bound[i]) continue;
    if (++failures <= 5)
      ADD_FAILURE() << what << "[" << i << "] = " << got[i] << ", want " << want[i] << " within " << bound[i];
  }
  EXPECT_EQ(failures, 0) << what << ": elements out of their bound";
}
void expect_elementwise_equal(const std::vector<double>& got, const std::vector<double>& want, const char* what) {
  expect_elementwise_within(got, want, std::vector<double>(want.size(), 0.0), what);
}

// Unit roundoffs of rounding to nearest: f32 keeps 24 significand bits, bf16 8 (core/dtype.h rounds to nearest
// even), double 53; a rounded value is within u·|value| of the exact one (half an ulp).
constexpr double kF32Unit = 0x1p-24, kBf16Unit = 0x1p-8, kF64Unit = 0x1p-53;

// Higham's γ_n = n·u / (1 − n·u): a sum (or dot product) whose every term passes through at most n roundings of
// unit u is within γ_n · Σ|terms| of the exact sum, in whatever order it is added.
double gamma_n(int64_t n, double u) { return static_cast<double>(n) * u / (1 - static_cast<double>(n) * u); }

// The bound on |got − want| for an output these ops sum in f32, each term through at most n roundings (products and
// additions), over terms whose magnitudes sum to `magnitude`, and then store in `dt`: γ_n(f32)·magnitude for the f32
// sum a, and in bf16 one more rounding of a, at most 2^-8·|a| <= 2^-8·(|want| + γ_n·magnitude). `want` is the
// double reference of the same formula over the same (already rounded) inputs; its own error, γ_{n+1} in double's
// unit, is added so that the bound holds against the reference as computed. No looser: one bf16 rounding of the
// output is all the error bf16 adds, since the sums are kept in f32.
double sum_bound(DType dt, int64_t n, double want, double magnitude) {
  const double out = dt == DType::f32 ? 0.0 : kBf16Unit;  // f32 outputs are the f32 sum itself
  return out * std::abs(want) + (1 + out) * gamma_n(n, kF32Unit) * magnitude + gamma_n(n + 1, kF64Unit) * magnitude;
}

// The dispatch copies rows, so it is exact; the combine of a token's k rows is a dot product of k terms (each
// through its product's rounding and at most k − 1 additions: n = k), and with a residual k + 1 terms, added to the
// f32 sum before the one rounding to y's dtype (the block's output is rounded once, not the combine and then the
// sum). In bf16 a second rounding would show where the residual cancels much of the combine: the combine's own
// rounding error, up to 2^-8 of the combine, can then be many times 2^-8 of y.
TEST(MoeDispatch, DispatchAndCombineIntoTheResidualMatchTheReferenceElementByElement) {
  const int64_t M = 23, k = 3, E = 5, D = 16;
  const ExpertRoutes r = random_routes(M, k, E);
  const std::vector<int32_t> row_of = values(r.row_of);
  for (const DType dt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    const Tensor x = random_tensor({M, D}, dt, "x"), ye = random_tensor({M * k, D}, dt, "ye");
    const Tensor w = random_tensor({M, k}, DType::f32, "weights");
    const Tensor residual = random_tensor({M, D}, dt, "residual");
    // The outputs start as other values, so an element left unwritten shows.
    Tensor xe = random_tensor({M * k, D}, dt, "stale xe");
    Tensor y = random_tensor({M, D}, dt, "stale y"), y_residual = random_tensor({M, D}, dt, "stale y_residual");
    dispatch_forward(x, r, xe);
    combine_forward(ye, w, r, y);
    combine_forward(ye, w, r, y_residual, residual);
    const std::vector<double> xd = to_double(x), yed = to_double(ye), wd = to_double(w), rd = to_double(residual);
    std::vector<double> want_xe(size_t(M * k * D)), want_y(size_t(M * D), 0.0), magnitude_y(size_t(M * D), 0.0);
    for (int64_t t = 0; t < M; ++t)
      for (int64_t j = 0; j < k; ++j) {
        const int64_t row = row_of[size_t(t * k + j)];
        for (int64_t d = 0; d < D; ++d) {
          const double term = wd[size_t(t * k + j)] * yed[size_t(row * D + d)];
          want_xe[size_t(row * D + d)] = xd[size_t(t * D + d)];
          want_y[size_t(t * D + d)] += term;
          magnitude_y[size_t(t * D + d)] += std::abs(term);
        }
      }
    std::vector<double> bound_y(want_y.size()), want_y_residual(want_y.size()), bound_y_residual(want_y.size());
    for (size_t i = 0; i < want_y.size(); ++i) {
      bound_y[i] = sum_bound(dt, k, want_y[i], magnitude_y[i]);
      want_y_residual[i] = rd[i] + want_y[i];
      bound_y_residual[i] = sum_bound(dt, k + 1, want_y_residual[i], magnitude_y[i] + std::abs(rd[i]));
    }
    expect_elementwise_equal(to_double(xe), want_xe, "xe");  // a copy
    expect_elementwise_within(to_double(y), want_y, bound_y, "y");
    expect_elementwise_within(to_double(y_residual), want_y_residual, bound_y_residual, "y with the residual");
  }
}

// The backwards, each element against the double reference of its formula:
//   dispatch   dx[t]           = Σ_j dxe[row of (t, j)]             k terms, k − 1 additions (the first is exact)
//   combine    dye[row (t, j)] = weights[t, j] · dy[t]              one f32 product, then y's dtype
//              dweights[t, j]  = Σ_d dy[t, d] · ye[row (t, j), d]   a dot product of D terms, kept in f32
TEST(MoeDispatch, TheBackwardsMatchTheReferenceElementByElement) {
  const int64_t M = 23, k = 3, E = 5, D = 16;
  const ExpertRoutes r = random_routes(M, k, E);
  const std::vector<int32_t> row_of = values(r.row_of);
  for (const DType dt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    const Tensor ye = random_tensor({M * k, D}, dt, "ye"), w = random_tensor({M, k}, DType::f32, "weights");
    const Tensor dy = random_tensor({M, D}, dt, "dy"), dxe = random_tensor({M * k, D}, dt, "dxe");
    // All three are overwritten (ops/moe_dispatch.h): they start as other values, so one left unwritten shows.
    Tensor dx = random_tensor({M, D}, dt, "stale dx"), dye = random_tensor({M * k, D}, dt, "stale dye");
    Tensor dw = random_tensor({M, k}, DType::f32, "stale dweights");
    dispatch_backward(dxe, r, dx);
    combine_backward(dy, ye, w, r, dye, dw);
    const std::vector<double> yed = to_double(ye), wd = to_double(w), dyd = to_double(dy), dxed = to_double(dxe);
    std::vector<double> want_dx(size_t(M * D), 0.0), magnitude_dx(size_t(M * D), 0.0);
    std::vector<double> want_dye(size_t(M * k * D)), want_dw(size_t(M * k), 0.0), magnitude_dw(size_t(M * k), 0.0);
    for (int64_t t = 0; t < M; ++t)
      for (int64_t j = 0; j < k; ++j) {
        const int64_t row = row_of[size_t(t * k + j)];
        for (int64_t d = 0; d < D; ++d) {
          const double g = dyd[size_t(t * D + d)], product = g * yed[size_t(row * D + d)];
          want_dx[size_t(t * D + d)] += dxed[size_t(row * D + d)];
          magnitude_dx[size_t(t * D + d)] += std::abs(dxed[size_t(row * D + d)]);
          want_dye[size_t(row * D + d)] = wd[size_t(t * k + j)] * g;
          want_dw[size_t(t * k + j)] += product;
          magnitude_dw[size_t(t * k + j)] += std::abs(product);
        }
      }
    std::vector<double> bound_dx(want_dx.size()), bound_dye(want_dye.size()), bound_dw(want_dw.size());
    for (size_t i = 0; i < want_dx.size(); ++i) bound_dx[i] = sum_bound(dt, k - 1, want_dx[i], magnitude_dx[i]);
    for (size_t i = 0; i < want_dye.size(); ++i) bound_dye[i] = sum_bound(dt, 1, want_dye[i], std::abs(want_dye[i]));
    for (size_t i = 0; i < want_dw.size(); ++i) bound_dw[i] = sum_bound(DType::f32, D, want_dw[i], magnitude_dw[i]);
    expect_elementwise_within(to_double(dx), want_dx, bound_dx, "dx");
    expect_elementwise_within(to_double(dye), want_dye, bound_dye, "dye");
    expect_elementwise_within(to_double(dw), want_dw, bound_dw, "dweights");
  }
}

// Expert parallelism's reordering copies rows as bytes, so every element of the result is its source element exactly,
// in f32 and in bf16 (to_double of either is exact), against the loops of the definitions
//   gather_rows   dst[i] = src[index[i]]        scatter_rows   dst[index[i]] = src[i]
// and scattering by an index undoes gathering by it, bit for bit.
TEST(MoeDispatch, GatherAndScatterRowsMoveEachRowExactly) {
  // i ↦ (37·i + 11) mod 150 is a permutation (37 is prime to 150) that moves every row (36·i ≡ −11 mod 150 has no
  // solution: gcd(36, 150) = 6 does not divide 11) and is not its own inverse (applied twice it is 19·i + 118), so
  // gathering and scattering differ; 150 rows are more than one of parallel_for's 64-row chunks, and rows of an odd
  // D = 7 are no whole number of vectors.
  const int64_t n = 150, D = 7;
  Tensor index = Tensor::empty({n}, DType::i32, MemCategory::workspace, "index");
  for (int64_t i = 0; i < n; ++i) index.data<int32_t>()[i] = static_cast<int32_t>((37 * i + 11) % n);
  const std::vector<int32_t> idx = values(index);
  for (const DType dt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    const Tensor src = random_tensor({n, D}, dt, "src");
    // The outputs start as other values, so a row left unwritten shows.
    Tensor gathered = random_tensor({n, D}, dt, "stale gathered");
    Tensor scattered = random_tensor({n, D}, dt, "stale scattered");
    gather_rows(src, index, gathered);
    scatter_rows(src, index, scattered);
    const std::vector<double> s = to_double(src);
    std::vector<double> want_gathered(s.size()), want_scattered(s.size());
    for (int64_t i = 0; i < n; ++i)
      for (int64_t d = 0; d < D; ++d) {
        want_gathered[size_t(i * D + d)] = s[size_t(idx[size_t(i)] * D + d)];
        want_scattered[size_t(idx[size_t(i)] * D + d)] = s[size_t(i * D + d)];
      }
    expect_elementwise_equal(to_double(gathered), want_gathered, "gathered");
    expect_elementwise_equal(to_double(scattered), want_scattered, "scattered");
    Tensor back = random_tensor({n, D}, dt, "stale back");
    scatter_rows(gathered, index, back);
    EXPECT_TRUE(same_bytes(back, src)) << "scatter_rows does not undo gather_rows";
  }
}

// A route to an expert that does not exist is a bug upstream (the router
// makes none): it stops the program, naming the route.
TEST(MoeDispatchDeathTest, AnExpertOutOfRangeStopsNamingTheRoute) {
  EXPECT_DEATH(sort_routes(experts_of({0, 4}, 2, 1), 4), "route 1 to expert 4 of 4");
}

}  // namespace
