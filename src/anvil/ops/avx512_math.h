// AVX-512 building blocks shared by the element-wise kernels (SwiGLU, the loss
// head, AdamW): a vector exp and an exact round-to-nearest-even bf16 store.
#pragma once
#include <cstdint>

#include "anvil/core/dtype.h"

#if defined(__AVX512F__)
#include <immintrin.h>

namespace anvil::avx512 {

// exp(x) for x ≤ 88; inputs below `lowest` are computed as exp(lowest) (NaN
// passes through). x = n·ln2 + r with |r| ≤ ln2/2; e^r by its Taylor series to
// degree 7 (truncation < 6e-9 relative, below f32 rounding); scalef multiplies
// by 2^n and underflows gracefully to denormals and zero. ln2 is split in a
// part with few bits (n·hi is exact) and the rest (Cody–Waite).
inline __m512 exp(__m512 x, float lowest) {
  x = _mm512_max_ps(_mm512_set1_ps(lowest), x);  // NaN in x is kept (max returns its 2nd operand)
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

#if defined(__AVX512BW__) && defined(__AVX512VL__)
// Stores the lanes selected by k as bf16, rounded to nearest even bit for bit
// as bf16::from_float (integer add of 0x7fff plus the lowest kept bit; NaN kept
// quiet). Unlike AVX512-BF16's conversion it keeps f32 denormals.
inline void store_bf16_rne(bf16* p, __m512 x, __mmask16 k) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i hi = _mm512_srli_epi32(u, 16);
  const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
  _mm256_mask_storeu_epi16(p, k, _mm512_cvtepi32_epi16(r));
}
#endif

}  // namespace anvil::avx512

#endif
