// 16 floats at a time, loaded from and stored to f32 or bf16: the vector type
// shared by the memory-bound kernels (embedding, RMSNorm, RoPE). AVX-512 with
// BF16 when the build targets it, a plain array the compiler vectorises
// otherwise, so the same kernel source serves both.
#pragma once
#include <bit>
#include <cstdint>

#include "anvil/core/dtype.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define ANVIL_VEC16_AVX512 1
#endif

namespace anvil::vec16 {

// ---- 16 floats at a time, loaded from / stored to f32 or bf16 ----
// AVX-512 when the build targets it (bf16 <-> f32 in one instruction each way,
// masked loads/stores for the tail of a row), a plain array the compiler
// vectorises otherwise. `n` in the tail forms is the count of valid lanes, 1..16.
constexpr int64_t kW = 16;
#ifdef ANVIL_VEC16_AVX512
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
inline V mul_add(V a, V b, V c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a·b + c
inline V mul_sub(V a, V b, V c) { return {_mm512_fmsub_ps(a.v, b.v, c.v)}; }  // a·b − c
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
inline V mul_add(V a, V b, V c) { return a * b + c; }
inline V mul_sub(V a, V b, V c) { return a * b - c; }
inline float hsum(V a) {
  float s = 0;
  for (float e : a.v) s += e;
  return s;
}
#endif

}  // namespace anvil::vec16
