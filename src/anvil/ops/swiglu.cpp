#include "anvil/ops/swiglu.h"

#include <cmath>

#include "anvil/core/dry_run.h"
#include "anvil/core/op_timer.h"
#include "anvil/core/parallel_for.h"
#include "anvil/ops/gpu_kernels.h"
#include "anvil/ops/avx512_math.h"
#include "anvil/ops/cuda/swiglu_body.h"  // plain C++: the portable path shares its sigmoid

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define ANVIL_SWIGLU_AVX512 1
#endif

namespace anvil {

namespace {

// Elements per chunk at least: below this a second thread costs more than it saves.
constexpr int64_t kGrain = 1 << 15;

#ifdef ANVIL_SWIGLU_AVX512

// ---- 16 elements at a time; the mask k selects the valid lanes of a tail ----

inline __m512 load16(const float* p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
inline __m512 load16(const bf16* p, __mmask16 k) {
  // bf16 is the top half of an f32: widen to 32 bits and shift into place.
  const __m256i h = _mm256_maskz_loadu_epi16(k, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void store16(float* p, __m512 x, __mmask16 k) { _mm512_mask_storeu_ps(p, k, x); }
inline void store16(bf16* p, __m512 x, __mmask16 k) {
#ifdef __AVX512BF16__
  // One instruction, round to nearest even; like AMX it flushes f32 denormals
  // (|x| < 1.2e-38) to zero, otherwise it is bit for bit bf16::from_float. The
  // integer version below costs ~8 more vector ops, and this kernel is close
  // to compute-bound in bf16.
  _mm256_mask_storeu_epi16(p, k, (__m256i)_mm512_cvtneps_pbh(x));
#else
  avx512::store_bf16_rne(p, x, k);
#endif
}

inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << remaining) - 1u);
}


// s = sigmoid(z) and oms = 1 − s, both to full relative precision.
// With e = exp(−|z|) ∈ (0, 1] and r = 1/(1 + e):
//   z ≥ 0: s = r,   1 − s = e·r
//   z < 0: s = e·r, 1 − s = r
// Nothing overflows for any z, and 1 − s is never formed by cancellation.
struct SigmoidParts {
  __m512 e, r;
  __mmask16 neg;  // lanes with z < 0
};
inline SigmoidParts sigmoid_parts(__m512 z) {
  const __m512 neg_abs = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(z), _mm512_set1_epi32(INT32_MIN)));
  const __m512 e = avx512::exp(neg_abs, -150.0f);
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.0f), e);  // in [1, 2]
  // 1/d: a 14-bit estimate and one Newton step (about 1 ulp), much cheaper than a division.
  const __m512 y0 = _mm512_rcp14_ps(d);
  const __m512 r = _mm512_fmadd_ps(y0, _mm512_fnmadd_ps(d, y0, _mm512_set1_ps(1.0f)), y0);
  return {e, r, _mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_LT_OQ)};
}
// A masked multiply picks r or e·r per lane in one instruction.
inline __m512 sigmoid_of(const SigmoidParts& q) { return _mm512_mask_mul_ps(q.r, q.neg, q.e, q.r); }
inline __m512 one_minus_sigmoid_of(const SigmoidParts& q) {
  return _mm512_mask_mul_ps(q.r, static_cast<__mmask16>(~q.neg), q.e, q.r);
}

template <class T>
void forward_range(const T* g, const T* u, T* h, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; i += 16) {
    const __mmask16 k = tail_mask(hi - i);
    const __m512 z = load16(g + i, k);
    const __m512 up = load16(u + i, k);
    const __m512 s = sigmoid_of(sigmoid_parts(z));
    store16(h + i, _mm512_mul_ps(_mm512_mul_ps(z, s), up), k);
  }
}

template <class T>
void backward_range(const T* dh, const T* g, const T* u, T* dg, T* du, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; i += 16) {
    const __mmask16 k = tail_mask(hi - i);
    // All three inputs are loaded before anything is stored (in-place safety).
    const __m512 d = load16(dh + i, k);
    const __m512 z = load16(g + i, k);
    const __m512 up = load16(u + i, k);
    const SigmoidParts q = sigmoid_parts(z);
    const __m512 s = sigmoid_of(q), oms = one_minus_sigmoid_of(q);
    const __m512 silu = _mm512_mul_ps(z, s);
    const __m512 dsilu = _mm512_mul_ps(s, _mm512_fmadd_ps(z, oms, _mm512_set1_ps(1.0f)));
    store16(du + i, _mm512_mul_ps(d, silu), k);
    store16(dg + i, _mm512_mul_ps(_mm512_mul_ps(d, up), dsilu), k);
  }
}

#else  // portable fallback, same formulas one element at a time

// The sigmoid's two parts as the CUDA kernel's body computes them (one definition for both).
using kernel::sigmoid_parts;

template <class T>
void forward_range(const T* g, const T* u, T* h, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) {
    const float z = to_f32(g[i]);
    float s, oms;
    sigmoid_parts(z, s, oms);
    h[i] = from_f32<T>(z * s * to_f32(u[i]));
  }
}

template <class T>
void backward_range(const T* dh, const T* g, const T* u, T* dg, T* du, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) {
    const float d = to_f32(dh[i]), z = to_f32(g[i]), up = to_f32(u[i]);
    float s, oms;
    sigmoid_parts(z, s, oms);
    du[i] = from_f32<T>(d * z * s);
    dg[i] = from_f32<T>(d * up * (s * (1.0f + z * oms)));
  }
}

#endif

void check_same(const Tensor& a, const Tensor& b, const char* what) {
  ANVIL_ASSERT(a.shape() == b.shape() && a.dtype() == b.dtype(), "swiglu: ", what, " is ", shape_str(b.shape()), " ",
               dtype_name(b.dtype()), ", expected ", shape_str(a.shape()), " ", dtype_name(a.dtype()));
}

}  // namespace

void swiglu_forward(const Tensor& g, const Tensor& u, Tensor& h) {
  const ScopedOpTime op("swiglu.forward");
  check_same(g, u, "u");
  check_same(g, h, "h");
  if (on_gpu("swiglu.forward", g, u, h)) {
    if (g.numel() == 0 || dry_run()) return;
    return gpu_kernels("swiglu.forward").swiglu_forward(g.dtype(), g.raw(), u.raw(), h.raw(), g.numel());
  }
  if (dry_run()) return;
  const int64_t n = g.numel();
  switch (g.dtype()) {
    case DType::f32:
      parallel_for(0, n, kGrain, [&](int64_t lo, int64_t hi) {
        forward_range(g.data<float>(), u.data<float>(), h.data<float>(), lo, hi);
      });
      break;
    case DType::bf16:
      parallel_for(0, n, kGrain, [&](int64_t lo, int64_t hi) {
        forward_range(g.data<bf16>(), u.data<bf16>(), h.data<bf16>(), lo, hi);
      });
      break;
    default: ANVIL_ASSERT(false, "swiglu takes f32 or bf16, got ", dtype_name(g.dtype()));
  }
}

void swiglu_backward(const Tensor& dh, const Tensor& g, const Tensor& u, Tensor& dg, Tensor& du) {
  const ScopedOpTime op("swiglu.backward");
  check_same(g, dh, "dh");
  check_same(g, u, "u");
  check_same(g, dg, "dg");
  check_same(g, du, "du");
  ANVIL_ASSERT(g.numel() == 0 || dg.raw() != du.raw(), "swiglu_backward: dg and du must be different tensors");
  if (on_gpu("swiglu.backward", g, dh, u, dg, du)) {
    if (g.numel() == 0 || dry_run()) return;
    return gpu_kernels("swiglu.backward")
        .swiglu_backward(g.dtype(), dh.raw(), g.raw(), u.raw(), dg.raw(), du.raw(), g.numel());
  }
  if (dry_run()) return;
  const int64_t n = g.numel();
  switch (g.dtype()) {
    case DType::f32:
      parallel_for(0, n, kGrain, [&](int64_t lo, int64_t hi) {
        backward_range(dh.data<float>(), g.data<float>(), u.data<float>(), dg.data<float>(), du.data<float>(), lo, hi);
      });
      break;
    case DType::bf16:
      parallel_for(0, n, kGrain, [&](int64_t lo, int64_t hi) {
        backward_range(dh.data<bf16>(), g.data<bf16>(), u.data<bf16>(), dg.data<bf16>(), du.data<bf16>(), lo, hi);
      });
      break;
    default: ANVIL_ASSERT(false, "swiglu takes f32 or bf16, got ", dtype_name(g.dtype()));
  }
}

}  // namespace anvil
