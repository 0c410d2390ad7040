// Matrix products and the linear layer against a double-precision reference
// and central finite differences.
#include <gtest/gtest.h>

#include "anvil/core/parallel_for.h"
#include "anvil/ops/matmul.h"
#include "test_util.h"

using namespace anvil;
using namespace anvil::testing;

namespace {

// y[m,n] = Σ_k x[m,k]·w[n,k]
std::vector<double> ref_linear(const std::vector<double>& x, const std::vector<double>& w, int64_t M, int64_t N,
                               int64_t K) {
  std::vector<double> y(static_cast<size_t>(M * N));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += x[m * K + k] * w[n * K + k];
      y[m * N + n] = s;
    }
  return y;
}
// dx[m,k] = Σ_n dy[m,n]·w[n,k]
std::vector<double> ref_dx(const std::vector<double>& dy, const std::vector<double>& w, int64_t M, int64_t N,
                           int64_t K) {
  std::vector<double> dx(static_cast<size_t>(M * K));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) {
      double s = 0;
      for (int64_t n = 0; n < N; ++n) s += dy[m * N + n] * w[n * K + k];
      dx[m * K + k] = s;
    }
  return dx;
}
// dw[n,k] = Σ_m dy[m,n]·x[m,k]
std::vector<double> ref_dw(const std::vector<double>& dy, const std::vector<double>& x, int64_t M, int64_t N,
                           int64_t K) {
  std::vector<double> dw(static_cast<size_t>(N * K));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) {
      double s = 0;
      for (int64_t m = 0; m < M; ++m) s += dy[m * N + n] * x[m * K + k];
      dw[n * K + k] = s;
    }
  return dw;
}

struct Dims {
  int64_t M, N, K;
};
// Awkward sizes on purpose: a single token, primes, sizes just past a power of two.
const Dims kShapes[] = {{1, 5, 3}, {1, 64, 128}, {37, 64, 129}, {130, 257, 70}, {256, 96, 512}};

}  // namespace

TEST(Linear, F32ForwardAndBackwardMatchDoubleReference) {
  for (const Dims& d : kShapes) {
    SCOPED_TRACE(::testing::Message() << "M=" << d.M << " N=" << d.N << " K=" << d.K);
    Tensor x = random_tensor({d.M, d.K}, DType::f32, "x");
    Tensor w = random_tensor({d.N, d.K}, DType::f32, "w");
    Tensor dy = random_tensor({d.M, d.N}, DType::f32, "dy");
    Tensor y = Tensor::empty({d.M, d.N}, DType::f32, MemCategory::activations, "y");
    Tensor dx = Tensor::empty({d.M, d.K}, DType::f32, MemCategory::activations, "dx");
    Tensor dw = random_tensor({d.N, d.K}, DType::f32, "dw0");  // accumulates on top of this
    const auto xd = to_double(x), wd = to_double(w), dyd = to_double(dy), dw0 = to_double(dw);

    linear_forward(x, w, y);
    linear_backward_input(dy, w, dx);
    linear_backward_weight(dy, x, dw);

    auto want_dw = ref_dw(dyd, xd, d.M, d.N, d.K);
    for (size_t i = 0; i < want_dw.size(); ++i) want_dw[i] += dw0[i];
    // f32 products with f32 accumulation over K ≤ 512 terms: ~sqrt(K)·2^-24 relative.
    EXPECT_LT(rel_error(y, ref_linear(xd, wd, d.M, d.N, d.K)), 1e-6);
    EXPECT_LT(rel_error(dx, ref_dx(dyd, wd, d.M, d.N, d.K)), 1e-6);
    EXPECT_LT(rel_error(dw, want_dw), 1e-6);
  }
}

TEST(Linear, BackwardInputCanAccumulate) {
  const int64_t M = 9, N = 17, K = 33;
  Tensor w = random_tensor({N, K}, DType::f32, "w");
  Tensor dy = random_tensor({M, N}, DType::f32, "dy");
  Tensor dx = random_tensor({M, K}, DType::f32, "dx0");
  auto want = ref_dx(to_double(dy), to_double(w), M, N, K);
  const auto dx0 = to_double(dx);
  for (size_t i = 0; i < want.size(); ++i) want[i] += dx0[i];
  linear_backward_input(dy, w, dx, /*accumulate_dx=*/true);
  EXPECT_LT(rel_error(dx, want), 1e-6);
}

TEST(Linear, BackwardMatchesFiniteDifferences) {
  const int64_t M = 3, N = 4, K = 5;
  Tensor x = random_tensor({M, K}, DType::f32, "x");
  Tensor w = random_tensor({N, K}, DType::f32, "w");
  Tensor r = random_tensor({M, N}, DType::f32, "r");  // loss = Σ y·r, so dy = r
  const auto xd = to_double(x), wd = to_double(w), rd = to_double(r);
  auto loss_of_x = [&](const std::vector<double>& xv) { return weighted_sum(ref_linear(xv, wd, M, N, K), rd); };
  auto loss_of_w = [&](const std::vector<double>& wv) { return weighted_sum(ref_linear(xd, wv, M, N, K), rd); };

  Tensor dx = Tensor::empty({M, K}, DType::f32, MemCategory::activations, "dx");
  Tensor dw = Tensor::zeros({N, K}, DType::f32, MemCategory::gradients, "dw");
  linear_backward_input(r, w, dx);
  linear_backward_weight(r, x, dw);
  // The loss is bilinear, so central differences are exact up to double rounding.
  EXPECT_LT(rel_error(dx, numerical_grad(loss_of_x, xd)), 1e-6);
  EXPECT_LT(rel_error(dw, numerical_grad(loss_of_w, wd)), 1e-6);
}

TEST(Linear, Bf16MatchesReferenceOnRoundedInputs) {
  for (const Dims& d : kShapes) {
    SCOPED_TRACE(::testing::Message() << "M=" << d.M << " N=" << d.N << " K=" << d.K);
    Tensor x = random_tensor({d.M, d.K}, DType::bf16, "x");
    Tensor w = random_tensor({d.N, d.K}, DType::bf16, "w");
    Tensor dy = random_tensor({d.M, d.N}, DType::bf16, "dy");
    Tensor y = Tensor::empty({d.M, d.N}, DType::bf16, MemCategory::activations, "y");
    Tensor dx = Tensor::empty({d.M, d.K}, DType::bf16, MemCategory::activations, "dx");
    Tensor dw = Tensor::zeros({d.N, d.K}, DType::f32, MemCategory::gradients, "dw");  // f32 accumulator
    const auto xd = to_double(x), wd = to_double(w), dyd = to_double(dy);  // the values bf16 holds

    linear_forward(x, w, y);
    linear_backward_input(dy, w, dx);
    linear_backward_weight(dy, x, dw);

    // Products of bf16 values are exact in f32 and AMX accumulates in f32, so the
    // only sizeable error is rounding y and dx to bf16 (8 significant bits): at
    // most u = 2^-8 ≈ 0.0039 relative per element, hence at most u in norm. The
    // f32 gradient skips that rounding and must be f32-accurate.
    const double u = std::ldexp(1.0, -8);
    EXPECT_LT(rel_error(y, ref_linear(xd, wd, d.M, d.N, d.K)), u);
    EXPECT_LT(rel_error(dx, ref_dx(dyd, wd, d.M, d.N, d.K)), u);
    EXPECT_LT(rel_error(dw, ref_dw(dyd, xd, d.M, d.N, d.K)), 1e-5);
  }
}

TEST(Gemm, StridedTransposedScaledAccumulate) {
  // C[2:5, :] of a wider matrix += 0.5 · Aᵀ·B with A stored [K, M] inside a wider buffer.
  const int64_t M = 3, N = 4, K = 6, lda = 10, ldc = 7;
  Tensor a = random_tensor({K, lda}, DType::f32, "a");
  Tensor b = random_tensor({K, N}, DType::f32, "b");
  Tensor c = random_tensor({M, ldc}, DType::f32, "c");
  const auto ad = to_double(a), bd = to_double(b);
  auto want = to_double(c);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double s = 0;
      for (int64_t k = 0; k < K; ++k) s += ad[k * lda + m] * bd[k * N + n];
      want[m * ldc + n] += 0.5 * s;
    }
  GemmShape s{.M = M, .N = N, .K = K, .trans_a = true, .lda = lda, .ldc = ldc, .alpha = 0.5f, .accumulate = true};
  gemm(s, a.raw(), b.raw(), c.raw());
  EXPECT_LT(rel_error(c, want), 1e-6);  // columns N..ldc untouched: they are in `want` unchanged
}

TEST(Matmul, Bf16RunsOnAmxWhereTheCpuHasIt) {
  const std::string impl = matmul_impl_name(DType::bf16);
  std::printf("bf16 matmul kernel: %s\n", impl.c_str());
  if (!__builtin_cpu_supports("avx512f")) GTEST_SKIP() << "no AVX-512 on this CPU";
  // GCC 12's __builtin_cpu_supports has no "amx-bf16"; read it from CPUID leaf 7 (EDX bit 22).
  unsigned eax = 7, ebx = 0, ecx = 0, edx = 0;  // ecx = 0: sub-leaf 0
  __asm__("cpuid" : "+a"(eax), "=b"(ebx), "+c"(ecx), "=d"(edx));
  if (!(edx & (1u << 22))) GTEST_SKIP() << "CPU has no AMX-BF16; oneDNN picked " << impl;
  EXPECT_NE(impl.find("amx"), std::string::npos) << impl;
}

// Kernels call gemm from inside parallel regions (attention's tiles): concurrent
// calls of one cached primitive must not share scratch memory.
TEST(Gemm, ConcurrentCallsMatchSerialOnes) {
  struct Case {
    int64_t M, N, K;
    bool trans_b;
  };
  // Attention-tile-like shapes; oneDNN packs operands into its scratchpad for these.
  const Case cases[] = {{256, 256, 128, true}, {256, 128, 256, false}, {64, 128, 2048, true}, {96, 160, 200, false}};
  for (DType dt : {DType::f32, DType::bf16})
    for (const Case& c : cases) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dt) << " M=" << c.M << " N=" << c.N << " K=" << c.K);
      const int64_t tasks = 8;
      Tensor a = random_tensor({tasks, c.M, c.K}, dt, "a");
      Tensor b = random_tensor({tasks, c.K, c.N}, dt, "b");
      Tensor serial = Tensor::empty({tasks, c.M, c.N}, DType::f32, MemCategory::workspace, "serial");
      Tensor parallel = Tensor::empty({tasks, c.M, c.N}, DType::f32, MemCategory::workspace, "parallel");
      GemmShape s{.M = c.M, .N = c.N, .K = c.K, .trans_b = c.trans_b, .ab = dt, .c = DType::f32};
      const size_t es = dtype_size(dt);
      auto at = [&](const Tensor& t, int64_t i, int64_t elems, size_t bytes) {
        return static_cast<char*>(t.raw()) + static_cast<size_t>(i * elems) * bytes;
      };
      // The serial calls also run inside a parallel region (on its first thread), as the
      // concurrent ones do: a bf16 product outside one may run widened, in another order.
#pragma omp parallel num_threads(2)
      if (omp_get_thread_num() == 0)
        for (int64_t i = 0; i < tasks; ++i)
          gemm(s, at(a, i, c.M * c.K, es), at(b, i, c.K * c.N, es), at(serial, i, c.M * c.N, 4));
      for (int rep = 0; rep < 3; ++rep) {
        parallel_for(0, tasks, 1, [&](int64_t lo, int64_t hi) {
          for (int64_t i = lo; i < hi; ++i)
            gemm(s, at(a, i, c.M * c.K, es), at(b, i, c.K * c.N, es), at(parallel, i, c.M * c.N, 4));
        });
        EXPECT_EQ(max_abs_error(to_double(parallel), to_double(serial)), 0.0) << "rep " << rep;
      }
    }
}

// bf16 products widened to f32 (matmul.h): both routes, on any CPU, against a
// double reference, in every layout gemm() is called with; sizes that take more
// than one panel of A (or of K, with Aᵀ); bf16 C with a product added into it.
TEST(Gemm, Bf16ProductsMatchADoubleReferenceWidenedAndNative) {
  struct Case {
    int64_t M, N, K;
    bool trans_a, trans_b;
    DType c;
  };
  const Case cases[] = {
      {37, 65, 129, false, true, DType::f32},  {37, 65, 129, false, false, DType::bf16},
      {37, 65, 129, true, false, DType::f32},  {37, 65, 129, true, false, DType::bf16},
      {37, 65, 129, true, true, DType::f32},   {2100, 48, 2048, false, true, DType::f32},  // 2 panels of A
      {2100, 48, 2048, false, false, DType::bf16},  // 2 panels of A and of C
      {2100, 40, 2100, true, false, DType::f32},    // 2 panels of K
  };
  const bool chosen = bf16_products_widened();
  for (const bool widened : {false, true}) {
    // Without AVX-512 oneDNN has no native bf16 product: every one widens.
    if (!widened && !native_bf16_products()) {
      std::printf("no native bf16 products on this CPU (no AVX-512): the native half is not run\n");
      continue;
    }
    set_bf16_products_widened(widened);
    for (const Case& c : cases) {
      SCOPED_TRACE(::testing::Message() << (widened ? "widened" : "native") << " M=" << c.M << " N=" << c.N
                                        << " K=" << c.K << " ta=" << c.trans_a << " tb=" << c.trans_b << " C "
                                        << dtype_name(c.c));
      const int64_t lda = (c.trans_a ? c.M : c.K) + 3, ldb = (c.trans_b ? c.K : c.N) + 1, ldc = c.N + 2;
      Tensor a = random_tensor({c.trans_a ? c.K : c.M, lda}, DType::bf16, "a");
      Tensor b = random_tensor({c.trans_b ? c.N : c.K, ldb}, DType::bf16, "b");
      Tensor out = random_tensor({c.M, ldc}, c.c, "c");
      const std::vector<double> ad = to_double(a), bd = to_double(b), c0 = to_double(out);
      std::vector<double> want = c0;
      for (int64_t m = 0; m < c.M; ++m)
        for (int64_t n = 0; n < c.N; ++n) {
          double s = 0;
          for (int64_t k = 0; k < c.K; ++k)
            s += ad[c.trans_a ? k * lda + m : m * lda + k] * bd[c.trans_b ? n * ldb + k : k * ldb + n];
          want[m * ldc + n] += 0.5 * s;
        }
      GemmShape s{.M = c.M, .N = c.N, .K = c.K, .trans_a = c.trans_a, .trans_b = c.trans_b, .lda = lda, .ldb = ldb,
                  .ldc = ldc, .ab = DType::bf16, .c = c.c, .alpha = 0.5f, .accumulate = true};
      const WidenedBytes bytes = widened_operand_bytes(s);
      EXPECT_EQ(bytes.a > 0, widened);
      EXPECT_LE(bytes.a, kWidenedPanelBytes);
      gemm(s, a.raw(), b.raw(), out.raw());
      // f32 C: only f32 summation error; bf16 C: one rounding of the result (2^-8 relative).
      EXPECT_LT(rel_error(out, want), c.c == DType::f32 ? 1e-5 : 8e-3);
    }
  }
  set_bf16_products_widened(chosen);
}

namespace {

// A product with M (or K) left to each call against the same product at its
// fixed shape: the same bits, f32 and bf16, strided, transposed, scaled and
// accumulating; and one kernel for every count.
TEST(Gemm, ADimensionLeftToTheCallGivesTheFixedShapesBitsWithOneKernel) {
  struct Case {
    RuntimeDim open;
    bool trans_a, trans_b;
    DType ab, c;
  };
  const Case cases[] = {
      {RuntimeDim::m, false, true, DType::f32, DType::f32},     // an expert's forward rows
      {RuntimeDim::m, false, false, DType::bf16, DType::bf16},  // its input gradient, bf16
      {RuntimeDim::k, true, false, DType::f32, DType::f32},     // its weight gradient's sum over rows
      {RuntimeDim::k, true, false, DType::bf16, DType::f32},
  };
  const int64_t fixed_m = 24, fixed_k = 40, N = 36;
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << "open " << (c.open == RuntimeDim::m ? "M" : "K") << " ta=" << c.trans_a
                                      << " tb=" << c.trans_b << " " << dtype_name(c.ab) << "->" << dtype_name(c.c));
    size_t kernels = 0;
    for (const int64_t rows : {1, 7, 16, 33, 100}) {
      const int64_t M = c.open == RuntimeDim::m ? rows : fixed_m, K = c.open == RuntimeDim::k ? rows : fixed_k;
      // Strides that do not depend on the open dimension: A [K, 50] when transposed, B [K, N + 5] or [N, 70].
      const int64_t lda = c.trans_a ? 50 : K + 3, ldb = c.trans_b ? 70 : N + 5, ldc = N + 2;
      const Tensor a = random_tensor({c.trans_a ? K : M, lda}, c.ab, "a");
      const Tensor b = random_tensor({c.trans_b ? N : K, ldb}, c.ab, "b");
      const Tensor c0 = random_tensor({M, ldc}, c.c, "c");
      GemmShape s{.M = M,
                  .N = N,
                  .K = K,
                  .trans_a = c.trans_a,
                  .trans_b = c.trans_b,
                  .lda = lda,
                  .ldb = ldb,
                  .ldc = ldc,
                  .ab = c.ab,
                  .c = c.c,
                  .alpha = 0.5f,
                  .accumulate = true};
      Tensor fixed = c0.to(c.c, MemCategory::workspace, "fixed"), open = c0.to(c.c, MemCategory::workspace, "open");
      gemm(s, a.raw(), b.raw(), fixed.raw());
      s.runtime = c.open;
      const size_t before = gemm_kernels_cached();
      gemm(s, a.raw(), b.raw(), open.raw());
      kernels += gemm_kernels_cached() - before;
      EXPECT_EQ(max_abs_error(to_double(open), to_double(fixed)), 0.0) << rows << " rows";
    }
    EXPECT_LE(kernels, 1u);  // the first count made it (unless an earlier case had), the others reused it
  }
}

}  // namespace
