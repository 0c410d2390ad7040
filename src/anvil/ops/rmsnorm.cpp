#include "anvil/ops/rmsnorm.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

#include "anvil/core/parallel.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define ANVIL_RMSNORM_AVX512 1
#endif

namespace anvil {

namespace {

// ---- 16 floats at a time, loaded from / stored to f32 or bf16 ----
// AVX-512 when the build targets it (bf16 <-> f32 in one instruction each way,
// masked loads/stores for the tail of a row), a plain array the compiler
// vectorises otherwise. `n` in the tail forms is the count of valid lanes, 1..16.
constexpr int64_t kW = 16;
#ifdef ANVIL_RMSNORM_AVX512
struct V {
  __m512 v;
};
inline __mmask16 lanes(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }
// bf16 -> f32 is a 16-bit left shift. The maskz forms (all lanes on) avoid GCC 12's
// false "may be used uninitialized" on the plain intrinsics' undefined operand.
inline V widen(__m256i h) {
  return {_mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xffff, _mm512_maskz_cvtepu16_epi32(0xffff, h), 16))};
}
inline __m256i narrow(V a) { return std::bit_cast<__m256i>(_mm512_cvtneps_pbh(a.v)); }  // round to nearest even
inline V load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline V load(const float* p, int64_t n) { return {_mm512_maskz_loadu_ps(lanes(n), p)}; }
inline V load(const bf16* p) { return widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline V load(const bf16* p, int64_t n) { return widen(_mm256_maskz_loadu_epi16(lanes(n), p)); }
inline void store(float* p, V a) { _mm512_storeu_ps(p, a.v); }
inline void store(float* p, V a, int64_t n) { _mm512_mask_storeu_ps(p, lanes(n), a.v); }
inline void store(bf16* p, V a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), narrow(a)); }
inline void store(bf16* p, V a, int64_t n) { _mm256_mask_storeu_epi16(p, lanes(n), narrow(a)); }
inline V splat(float x) { return {_mm512_set1_ps(x)}; }
inline V operator+(V a, V b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V operator-(V a, V b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V operator*(V a, V b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V madd(V a, V b, V c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a·b + c
inline float hsum(V a) {  // once per row: a plain sum (the intrinsic trips the same GCC warning)
  alignas(64) float t[kW];
  _mm512_store_ps(t, a.v);
  float s = 0;
  for (float e : t) s += e;
  return s;
}
#else
struct V {
  float v[kW];
};
template <class T>
inline V load(const T* p, int64_t n = kW) {
  V r{};
  for (int64_t i = 0; i < n; ++i) r.v[i] = to_f32(p[i]);
  return r;
}
template <class T>
inline void store(T* p, V a, int64_t n = kW) {
  for (int64_t i = 0; i < n; ++i) p[i] = from_f32<T>(a.v[i]);
}
inline V splat(float x) {
  V r;
  for (float& e : r.v) e = x;
  return r;
}
template <class F>
inline V lanewise(V a, V b, F f) {
  for (int64_t i = 0; i < kW; ++i) a.v[i] = f(a.v[i], b.v[i]);
  return a;
}
inline V operator+(V a, V b) { return lanewise(a, b, [](float x, float y) { return x + y; }); }
inline V operator-(V a, V b) { return lanewise(a, b, [](float x, float y) { return x - y; }); }
inline V operator*(V a, V b) { return lanewise(a, b, [](float x, float y) { return x * y; }); }
inline V madd(V a, V b, V c) { return a * b + c; }
inline float hsum(V a) {
  float s = 0;
  for (float e : a.v) s += e;
  return s;
}
#endif

// Σ x² over a row, with four accumulators (shorter dependency chains, and each
// accumulator sums a quarter of the row, which also helps f32 accuracy).
template <class T>
float sum_squares(const T* x, int64_t D) {
  V a0 = splat(0), a1 = splat(0), a2 = splat(0), a3 = splat(0);
  int64_t j = 0;
  for (; j + 4 * kW <= D; j += 4 * kW) {
    const V x0 = load(x + j), x1 = load(x + j + kW), x2 = load(x + j + 2 * kW), x3 = load(x + j + 3 * kW);
    a0 = madd(x0, x0, a0), a1 = madd(x1, x1, a1), a2 = madd(x2, x2, a2), a3 = madd(x3, x3, a3);
  }
  for (; j + kW <= D; j += kW) {
    const V v = load(x + j);
    a0 = madd(v, v, a0);
  }
  if (j < D) {
    const V v = load(x + j, D - j);
    a1 = madd(v, v, a1);
  }
  return hsum((a0 + a1) + (a2 + a3));
}

// Rows per parallel task, so each task moves a few hundred KB: big enough to
// amortise the fork, small enough that both cores get work at M = a few rows.
int64_t row_grain(int64_t D) { return std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, D)); }

float rstd_of(float sum_sq, int64_t D, float eps) {
  return 1.0f / std::sqrt(sum_sq / static_cast<float>(D) + eps);
}

template <class T>
void forward_kernel(const T* x, const T* w, float eps, T* y, float* rstd, int64_t M, int64_t D) {
  parallel_for(0, M, row_grain(D), [&](int64_t lo, int64_t hi) {
    for (int64_t m = lo; m < hi; ++m) {
      const T* xr = x + m * D;
      T* yr = y + m * D;
      // Second read of the row below hits L1/L2: one pass over memory.
      const float r = rstd_of(sum_squares(xr, D), D, eps);
      if (rstd) rstd[m] = r;
      const V rv = splat(r);
      int64_t j = 0;
      for (; j + kW <= D; j += kW) store(yr + j, load(xr + j) * rv * load(w + j));
      if (j < D) store(yr + j, load(xr + j, D - j) * rv * load(w + j, D - j), D - j);
    }
  });
}

// With r = rstd of the row and dot = Σ_k dy_k·w_k·x_k:
//   dx_j = r·dy_j·w_j − (r³/D)·dot·x_j      (∂r/∂x_k = −r³·x_k/D)
//   dw_j += dy_j·x_j·r
// Per row: one sweep for dot (and Σx² when rstd was not saved), one sweep that
// writes dx and adds into the chunk's dw partial; both read x, dy, w from L1.
template <class T>
void backward_row(const T* dy, const T* x, const T* w, const float* rstd_saved, float eps, int64_t D, T* dx,
                  float* pdw, bool accumulate_dx) {
  V d0 = splat(0), d1 = splat(0), s0 = splat(0), s1 = splat(0);
  int64_t j = 0;
  for (; j + kW <= D; j += kW) {
    const V xv = load(x + j);
    d0 = madd(load(dy + j) * load(w + j), xv, d0);
    if (!rstd_saved) s0 = madd(xv, xv, s0);
  }
  if (j < D) {
    const V xv = load(x + j, D - j);
    d1 = madd(load(dy + j, D - j) * load(w + j, D - j), xv, d1);
    s1 = madd(xv, xv, s1);
  }
  const float r = rstd_saved ? *rstd_saved : rstd_of(hsum(s0 + s1), D, eps);
  const float dot = hsum(d0 + d1);
  const V rv = splat(r);
  const V cv = splat(r * r * r * dot / static_cast<float>(D));
  auto dx_of = [&](V dyv, V wv, V xv) { return dyv * wv * rv - cv * xv; };
  for (j = 0; j + kW <= D; j += kW) {
    const V xv = load(x + j), dyv = load(dy + j);
    V g = dx_of(dyv, load(w + j), xv);
    if (accumulate_dx) g = g + load(dx + j);
    store(dx + j, g);
    store(pdw + j, madd(dyv * xv, rv, load(pdw + j)));
  }
  if (j < D) {
    const int64_t n = D - j;
    const V xv = load(x + j, n), dyv = load(dy + j, n);
    V g = dx_of(dyv, load(w + j, n), xv);
    if (accumulate_dx) g = g + load(dx + j, n);
    store(dx + j, g, n);
    store(pdw + j, madd(dyv * xv, rv, load(pdw + j, n)), n);
  }
}

template <class T, class G>
void backward_kernel(const T* dy, const T* x, const T* w, const float* rstd, float eps, T* dx, G* dw, int64_t M,
                     int64_t D, bool accumulate_dx) {
  // dw is a reduction over rows. Fixed chunks of rows (a function of the shape
  // only, not of the thread count) each sum into their own f32 partial row;
  // then the partials are summed column-wise into dw. Race-free, deterministic,
  // and the partials cost ~0.5% of the traffic at D = 2048 (one 8 KB row per
  // 256 rows of input).
  const int64_t rows_per_chunk = std::max<int64_t>(16, (int64_t{1} << 19) / std::max<int64_t>(1, D));
  const int64_t chunks = (M + rows_per_chunk - 1) / rows_per_chunk;
  Tensor partial = Tensor::empty({chunks, D}, DType::f32, MemCategory::workspace, "rmsnorm.dw_partial");
  float* part = partial.data<float>();
  parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      float* pdw = part + c * D;
      std::memset(pdw, 0, static_cast<size_t>(D) * sizeof(float));
      const int64_t hi = std::min(M, (c + 1) * rows_per_chunk);
      for (int64_t m = c * rows_per_chunk; m < hi; ++m)
        backward_row(dy + m * D, x + m * D, w, rstd ? rstd + m : nullptr, eps, D, dx + m * D, pdw, accumulate_dx);
    }
  });
  parallel_for(0, D, 4096, [&](int64_t lo, int64_t hi) {
    for (int64_t j = lo; j < hi; ++j) {
      float s = 0;
      for (int64_t c = 0; c < chunks; ++c) s += part[c * D + j];
      dw[j] = from_f32<G>(to_f32(dw[j]) + s);
    }
  });
}

}  // namespace

void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, Tensor& y, const Tensor& rstd) {
  ANVIL_ASSERT(x.ndim() >= 1 && w.ndim() == 1 && x.size(-1) == w.size(0), "rmsnorm: x ", shape_str(x.shape()),
               " w ", shape_str(w.shape()));
  ANVIL_ASSERT(x.dtype() != DType::i32 && w.dtype() == x.dtype() && y.dtype() == x.dtype(),
               "rmsnorm: x, w, y must share one float dtype");
  ANVIL_ASSERT(y.shape() == x.shape(), "rmsnorm: y ", shape_str(y.shape()), " vs x ", shape_str(x.shape()));
  const int64_t D = w.size(0), M = D ? x.numel() / D : 0;
  float* rs = nullptr;
  if (rstd.defined()) {
    ANVIL_ASSERT(rstd.dtype() == DType::f32 && rstd.numel() == M, "rmsnorm: rstd ", shape_str(rstd.shape()));
    rs = rstd.data<float>();
  }
  if (M == 0 || D == 0) return;
  if (x.dtype() == DType::f32)
    forward_kernel(x.data<float>(), w.data<float>(), eps, y.data<float>(), rs, M, D);
  else
    forward_kernel(x.data<bf16>(), w.data<bf16>(), eps, y.data<bf16>(), rs, M, D);
}

void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd, float eps, Tensor& dx,
                      Tensor& dw, bool accumulate_dx) {
  ANVIL_ASSERT(x.ndim() >= 1 && w.ndim() == 1 && x.size(-1) == w.size(0), "rmsnorm: x ", shape_str(x.shape()),
               " w ", shape_str(w.shape()));
  ANVIL_ASSERT(x.dtype() != DType::i32 && w.dtype() == x.dtype() && dy.dtype() == x.dtype() &&
                   dx.dtype() == x.dtype(),
               "rmsnorm backward: x, w, dy, dx must share one float dtype");
  ANVIL_ASSERT(dy.shape() == x.shape() && dx.shape() == x.shape(), "rmsnorm backward: dy ", shape_str(dy.shape()),
               " dx ", shape_str(dx.shape()), " x ", shape_str(x.shape()));
  ANVIL_ASSERT(dw.shape() == w.shape() && dw.dtype() != DType::i32, "rmsnorm backward: dw ", shape_str(dw.shape()));
  const int64_t D = w.size(0), M = D ? x.numel() / D : 0;
  const float* rs = nullptr;
  if (rstd.defined()) {
    ANVIL_ASSERT(rstd.dtype() == DType::f32 && rstd.numel() == M, "rmsnorm: rstd ", shape_str(rstd.shape()));
    rs = rstd.data<float>();
  }
  if (M == 0 || D == 0) return;
  auto run = [&](auto* dwp) {
    if (x.dtype() == DType::f32)
      backward_kernel(dy.data<float>(), x.data<float>(), w.data<float>(), rs, eps, dx.data<float>(), dwp, M, D,
                      accumulate_dx);
    else
      backward_kernel(dy.data<bf16>(), x.data<bf16>(), w.data<bf16>(), rs, eps, dx.data<bf16>(), dwp, M, D,
                      accumulate_dx);
  };
  if (dw.dtype() == DType::f32)
    run(dw.data<float>());
  else
    run(dw.data<bf16>());
}

}  // namespace anvil
