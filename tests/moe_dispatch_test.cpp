// Dropless dispatch of tokens to experts and the weighted combine
// (ops/moe_dispatch.h): the routes' order by hand, both ops against a double
// reference in f32 and bf16, their backwards as exact adjoints, and the
// routing where every token picks one expert.
#include "anvil/ops/moe_dispatch.h"

#include <gtest/gtest.h>

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

TEST(MoeDispatch, DispatchAndCombineMatchTheReferenceAndTheirBackwardsAreAdjoints) {
  const int64_t M = 23, k = 3, E = 5, D = 16;
  const ExpertRoutes r = random_routes(M, k, E);
  const std::vector<int32_t> row_of = values(r.row_of);
  for (const DType dt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(dtype_name(dt));
    const double bound = dt == DType::f32 ? 1e-6 : 1e-2;
    const Tensor x = random_tensor({M, D}, dt, "x"), ye = random_tensor({M * k, D}, dt, "ye");
    const Tensor w = random_tensor({M, k}, DType::f32, "weights");
    const Tensor dy = random_tensor({M, D}, dt, "dy"), dxe = random_tensor({M * k, D}, dt, "dxe");
    Tensor xe = Tensor::empty({M * k, D}, dt, MemCategory::workspace, "xe");
    Tensor y = Tensor::empty({M, D}, dt, MemCategory::workspace, "y");
    dispatch_forward(x, r, xe);
    combine_forward(ye, w, r, y);
    const std::vector<double> xd = to_double(x), yed = to_double(ye), wd = to_double(w), dyd = to_double(dy);
    std::vector<double> want_xe(size_t(M * k * D)), want_y(size_t(M * D), 0.0);
    for (int64_t t = 0; t < M; ++t)
      for (int64_t j = 0; j < k; ++j) {
        const int64_t row = row_of[size_t(t * k + j)];
        for (int64_t d = 0; d < D; ++d) {
          want_xe[size_t(row * D + d)] = xd[size_t(t * D + d)];
          want_y[size_t(t * D + d)] += wd[size_t(t * k + j)] * yed[size_t(row * D + d)];
        }
      }
    EXPECT_EQ(max_abs_error(to_double(xe), want_xe), 0.0);  // a copy
    EXPECT_LT(rel_error(y, want_y), bound);
    // Adjoints: <dispatch(x), dxe> = <x, dispatch_backward(dxe)>; the combine is
    // linear in ye and in the weights: <combine(ye, w), dy> = <ye, dye> = <w, dweights>.
    Tensor dx = Tensor::empty({M, D}, dt, MemCategory::workspace, "dx");
    dispatch_backward(dxe, r, dx);
    Tensor dye = Tensor::empty({M * k, D}, dt, MemCategory::workspace, "dye");
    Tensor dw = Tensor::empty({M, k}, DType::f32, MemCategory::workspace, "dw");
    combine_backward(dy, ye, w, r, dye, dw);
    auto dot = [](const std::vector<double>& a, const std::vector<double>& b) {
      double s = 0;
      for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
      return s;
    };
    const double lhs_d = dot(want_xe, to_double(dxe)), rhs_d = dot(xd, to_double(dx));
    const double lhs_c = dot(want_y, dyd), by_ye = dot(yed, to_double(dye)), by_w = dot(wd, to_double(dw));
    std::printf("%s: <dispatch x, g> %.6f = <x, dispatch' g> %.6f; <combine, dy> %.6f = <ye, dye> %.6f = <w, dw> %.6f\n",
                dtype_name(dt), lhs_d, rhs_d, lhs_c, by_ye, by_w);
    EXPECT_NEAR(rhs_d, lhs_d, bound * std::abs(lhs_d) + 1e-9);
    EXPECT_NEAR(by_ye, lhs_c, bound * std::abs(lhs_c) + 1e-9);
    EXPECT_NEAR(by_w, lhs_c, bound * std::abs(lhs_c) + 1e-9);
  }
}

// A route to an expert that does not exist is a bug upstream (the router
// makes none): it stops the program, naming the route.
TEST(MoeDispatchDeathTest, AnExpertOutOfRangeStopsNamingTheRoute) {
  EXPECT_DEATH(sort_routes(experts_of({0, 4}, 2, 1), 4), "route 1 to expert 4 of 4");
}

}  // namespace
