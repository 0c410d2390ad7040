// The experts' grouped products (ops/moe_experts.h): forward, input gradient
// and weight gradient against a double reference in f32 and bf16, over
// routings with empty experts, one-row experts and experts longer than a row
// block; every row on one expert; the result the same on one thread and two;
// a bounded set of kernels whatever the row counts.
#include "anvil/ops/moe_experts.h"

#include <gtest/gtest.h>

#include <vector>

#include "anvil/core/parallel_for.h"
#include "anvil/ops/matmul.h"
#include "test_util.h"

namespace {

using namespace anvil;
using namespace anvil::testing;

// Expert e's rows [offsets[e], offsets[e + 1]).
std::vector<int64_t> offsets_of(const std::vector<int64_t>& rows) {
  std::vector<int64_t> o{0};
  for (int64_t r : rows) o.push_back(o.back() + r);
  return o;
}

struct Reference {
  std::vector<double> y, dx, dw;
};

// y = x·w[e]ᵀ, dx = dy·w[e] per row of expert e, dw[e] = Σ its rows dyᵀ·x, in double.
Reference reference(const Tensor& x, const Tensor& w, const Tensor& dy, const std::vector<int64_t>& offsets) {
  const int64_t R = x.size(0), K = x.size(1), E = w.size(0), N = w.size(1);
  const std::vector<double> xd = to_double(x), wd = to_double(w), dyd = to_double(dy);
  Reference ref{std::vector<double>(static_cast<size_t>(R * N)), std::vector<double>(static_cast<size_t>(R * K)),
                std::vector<double>(static_cast<size_t>(E * N * K))};
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = offsets[static_cast<size_t>(e)]; r < offsets[static_cast<size_t>(e + 1)]; ++r)
      for (int64_t n = 0; n < N; ++n)
        for (int64_t k = 0; k < K; ++k) {
          const double wv = wd[static_cast<size_t>((e * N + n) * K + k)];
          ref.y[static_cast<size_t>(r * N + n)] += xd[static_cast<size_t>(r * K + k)] * wv;
          ref.dx[static_cast<size_t>(r * K + k)] += dyd[static_cast<size_t>(r * N + n)] * wv;
          ref.dw[static_cast<size_t>((e * N + n) * K + k)] +=
              dyd[static_cast<size_t>(r * N + n)] * xd[static_cast<size_t>(r * K + k)];
        }
  return ref;
}

struct Result {
  Tensor y, dx, dw;
};

// The three products; dw starts at `dw0` (they accumulate).
Result run(const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dw0, const std::vector<int64_t>& offsets) {
  const int64_t R = x.size(0), K = x.size(1), N = w.size(1);
  Result out{Tensor::empty({R, N}, x.dtype(), MemCategory::workspace, "y"),
             Tensor::empty({R, K}, x.dtype(), MemCategory::workspace, "dx"),
             dw0.to(DType::f32, MemCategory::workspace, "dw")};
  grouped_linear_forward(x, w, offsets, out.y);
  grouped_linear_backward_input(dy, w, offsets, out.dx);
  grouped_linear_backward_weight(dy, x, offsets, out.dw);
  return out;
}

// Experts of 0, 1, 300 (three row blocks), 7, 0 and 600 (two weight blocks) rows.
const std::vector<int64_t> kRows = {0, 1, 300, 7, 0, 600};

TEST(MoeExperts, GroupedProductsMatchADoubleReference) {
  const int64_t E = static_cast<int64_t>(kRows.size()), K = 48, N = 40;
  const std::vector<int64_t> offsets = offsets_of(kRows);
  const int64_t R = offsets.back();
  // f32: a K-term dot product rounds by ~sqrt(K)·6e-8; the weight gradient
  // sums up to 600 rows. bf16: outputs rounded once (2^-9 relative), the
  // weight gradient kept in f32.
  for (const auto& [dt, bound_out, bound_dw] : {std::tuple{DType::f32, 1e-6, 1e-6}, std::tuple{DType::bf16, 4e-3, 1e-6}}) {
    SCOPED_TRACE(dtype_name(dt));
    const Tensor x = random_tensor({R, K}, dt, "x"), w = random_tensor({E, N, K}, dt, "w"),
                 dy = random_tensor({R, N}, dt, "dy"), dw0 = random_tensor({E, N, K}, DType::f32, "dw0");
    const Result got = run(x, w, dy, dw0, offsets);
    Reference ref = reference(x, w, dy, offsets);
    const std::vector<double> dw0d = to_double(dw0);
    for (size_t i = 0; i < ref.dw.size(); ++i) ref.dw[i] += dw0d[i];  // accumulated onto what dw held
    const double ey = rel_error(got.y, ref.y), edx = rel_error(got.dx, ref.dx), edw = rel_error(got.dw, ref.dw);
    std::printf("%s: relative error y %.2e, dx %.2e, dw %.2e\n", dtype_name(dt), ey, edx, edw);
    EXPECT_LT(ey, bound_out);
    EXPECT_LT(edx, bound_out);
    EXPECT_LT(edw, bound_dw);
  }
}

// Dropless: every row on one expert (of 8) is one run, the same as on any other.
TEST(MoeExperts, EveryRowOnOneExpert) {
  const int64_t E = 8, R = 333, K = 32, N = 24;
  for (int64_t chosen : {0, 5, 7}) {
    std::vector<int64_t> rows(static_cast<size_t>(E), 0);
    rows[static_cast<size_t>(chosen)] = R;
    const std::vector<int64_t> offsets = offsets_of(rows);
    const Tensor x = random_tensor({R, K}, DType::f32, "x"), w = random_tensor({E, N, K}, DType::f32, "w"),
                 dy = random_tensor({R, N}, DType::f32, "dy");
    const Tensor dw0 = Tensor::zeros({E, N, K}, DType::f32, MemCategory::workspace, "dw0");
    const Result got = run(x, w, dy, dw0, offsets);
    const Reference ref = reference(x, w, dy, offsets);
    EXPECT_LT(rel_error(got.y, ref.y), 1e-6) << chosen;
    EXPECT_LT(rel_error(got.dx, ref.dx), 1e-6) << chosen;
    EXPECT_LT(rel_error(got.dw, ref.dw), 1e-6) << chosen;
    // The other experts' weight gradients stay zero.
    const std::vector<double> dw = to_double(got.dw);
    double others = 0;
    for (int64_t e = 0; e < E; ++e)
      if (e != chosen)
        for (int64_t i = 0; i < N * K; ++i) others = std::max(others, std::abs(dw[static_cast<size_t>(e * N * K + i)]));
    EXPECT_EQ(others, 0.0) << chosen;
  }
}

// Each output element is one product's (dw: one expert's blocks in row
// order), so the thread count changes no bit.
TEST(MoeExperts, OneThreadAndTwoGiveTheSameBits) {
  const int64_t E = static_cast<int64_t>(kRows.size()), K = 40, N = 56;
  const std::vector<int64_t> offsets = offsets_of(kRows);
  const int64_t R = offsets.back();
  const Tensor x = random_tensor({R, K}, DType::bf16, "x"), w = random_tensor({E, N, K}, DType::bf16, "w"),
               dy = random_tensor({R, N}, DType::bf16, "dy");
  const Tensor dw0 = Tensor::zeros({E, N, K}, DType::f32, MemCategory::workspace, "dw0");
  const int before = num_threads();
  set_num_threads(1);
  const Result one = run(x, w, dy, dw0, offsets);
  set_num_threads(2);
  const Result two = run(x, w, dy, dw0, offsets);
  set_num_threads(before);
  EXPECT_EQ(max_abs_error(to_double(one.y), to_double(two.y)), 0.0);
  EXPECT_EQ(max_abs_error(to_double(one.dx), to_double(two.dx)), 0.0);
  EXPECT_EQ(max_abs_error(to_double(one.dw), to_double(two.dw)), 0.0);
}

// Each product shape keeps a oneDNN kernel for the life of the process, so
// learned routing, whose row counts change every step, must not make one per
// row count: over every count from 1 to 600 rows (tails of every size, for
// the row blocks and the weight blocks) each of the three products makes two,
// its whole block's and its tails'.
TEST(MoeExperts, EveryRowCountMakesABoundedSetOfKernels) {
  const int64_t K = 20, N = 24, max_rows = 600;
  const Tensor w = random_tensor({1, N, K}, DType::f32, "w");
  Tensor dw = Tensor::zeros({1, N, K}, DType::f32, MemCategory::workspace, "dw");
  const size_t before = gemm_kernels_cached();
  for (int64_t rows = 1; rows <= max_rows; ++rows) {
    const Tensor x = random_tensor({rows, K}, DType::f32, "x"), dy = random_tensor({rows, N}, DType::f32, "dy");
    Tensor y = Tensor::empty({rows, N}, DType::f32, MemCategory::workspace, "y");
    Tensor dx = Tensor::empty({rows, K}, DType::f32, MemCategory::workspace, "dx");
    const std::vector<int64_t> offsets{0, rows};
    grouped_linear_forward(x, w, offsets, y);
    grouped_linear_backward_input(dy, w, offsets, dx);
    grouped_linear_backward_weight(dy, x, offsets, dw);
  }
  const size_t made = gemm_kernels_cached() - before;
  std::printf("%d row counts made %zu kernels\n", static_cast<int>(max_rows), made);
  EXPECT_EQ(made, 3u * 2u);
}

}  // namespace
