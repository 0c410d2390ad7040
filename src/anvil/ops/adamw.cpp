#include "anvil/ops/adamw.h"

#include <cmath>

#include "anvil/core/dry_run.h"
#include "anvil/core/op_timer.h"
#include "anvil/core/parallel_for.h"
#include "anvil/ops/gpu_kernels.h"
#include "anvil/ops/avx512_math.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define ANVIL_ADAMW_AVX512 1
#endif

namespace anvil {

namespace {

constexpr int64_t kGrain = 1 << 15;  // elements per chunk at least

// The update of one element, the same FMAs and roundings in both paths below
// (and in the CUDA twin), so every CPU gives the same bits:
//   m     = fma(m, β1, g·(1 − β1))
//   v     = fma(v, β2, (g·g)·(1 − β2))
//   denom = fma(sqrt(v), 1/sqrt(1 − β2^t), eps)  (= sqrt(v̂) + eps, as torch computes it)
//   p     = fma(−step_size, m/denom, p·(1 − lr·wd))
#ifdef ANVIL_ADAMW_AVX512

inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << remaining) - 1u);
}


template <bool kWriteBf16>
void adamw_range(const AdamWCoeffs& c, float* p, const float* g, float* m, float* v, bf16* pb, int64_t lo, int64_t hi) {
  const __m512 decay = _mm512_set1_ps(c.decay);
  const __m512 b1 = _mm512_set1_ps(c.beta1), omb1 = _mm512_set1_ps(c.one_minus_beta1);
  const __m512 b2 = _mm512_set1_ps(c.beta2), omb2 = _mm512_set1_ps(c.one_minus_beta2);
  const __m512 step = _mm512_set1_ps(c.step_size), inv_sqrt_bc2 = _mm512_set1_ps(c.inv_sqrt_bc2);
  const __m512 eps = _mm512_set1_ps(c.eps), scale = _mm512_set1_ps(c.grad_scale);
  for (int64_t i = lo; i < hi; i += 16) {
    const __mmask16 k = tail_mask(hi - i);
    const __m512 gi = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, g + i), scale);
    const __m512 mi = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, m + i), b1, _mm512_mul_ps(gi, omb1));
    const __m512 vi = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, v + i), b2, _mm512_mul_ps(_mm512_mul_ps(gi, gi), omb2));
    const __m512 denom = _mm512_fmadd_ps(_mm512_sqrt_ps(vi), inv_sqrt_bc2, eps);
    const __m512 pi = _mm512_fnmadd_ps(step, _mm512_div_ps(mi, denom), _mm512_mul_ps(_mm512_maskz_loadu_ps(k, p + i), decay));
    _mm512_mask_storeu_ps(m + i, k, mi);
    _mm512_mask_storeu_ps(v + i, k, vi);
    _mm512_mask_storeu_ps(p + i, k, pi);
    if constexpr (kWriteBf16) avx512::store_bf16_rne(pb + i, pi, k);
  }
}

#else  // portable fallback

template <bool kWriteBf16>
void adamw_range(const AdamWCoeffs& c, float* p, const float* g, float* m, float* v, bf16* pb, int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) {
    const float gi = g[i] * c.grad_scale;
    const float mi = std::fma(m[i], c.beta1, gi * c.one_minus_beta1);
    const float vi = std::fma(v[i], c.beta2, (gi * gi) * c.one_minus_beta2);
    const float denom = std::fma(std::sqrt(vi), c.inv_sqrt_bc2, c.eps);
    const float pi = std::fma(-c.step_size, mi / denom, p[i] * c.decay);
    m[i] = mi, v[i] = vi, p[i] = pi;
    if constexpr (kWriteBf16) pb[i] = from_f32<bf16>(pi);
  }
}

#endif

void check_f32(const Tensor& t, int64_t n, const char* name) {
  ANVIL_ASSERT(t.dtype() == DType::f32, "adamw: ", name, " must be f32, got ", dtype_name(t.dtype()));
  ANVIL_ASSERT(t.numel() == n, "adamw: ", name, " has ", t.numel(), " elements, p has ", n);
}

}  // namespace

AdamWCoeffs adamw_coeffs(const AdamWConfig& cfg, int64_t step, float grad_scale) {
  const double t = static_cast<double>(step);
  const double bc1 = 1.0 - std::pow(static_cast<double>(cfg.beta1), t);
  const double bc2 = 1.0 - std::pow(static_cast<double>(cfg.beta2), t);
  AdamWCoeffs c;
  c.decay = static_cast<float>(1.0 - static_cast<double>(cfg.lr) * cfg.weight_decay);
  c.beta1 = cfg.beta1;
  c.one_minus_beta1 = 1.0f - cfg.beta1;  // exact in f32 for β in [0.5, 1) (Sterbenz)
  c.beta2 = cfg.beta2;
  c.one_minus_beta2 = 1.0f - cfg.beta2;
  c.step_size = static_cast<float>(cfg.lr / bc1);
  c.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  c.eps = cfg.eps;
  c.grad_scale = grad_scale;
  return c;
}

void check_adamw_config(const AdamWConfig& c) {
  auto bad = [](const char* name, float value, const char* rule) {
    return detail::concat("AdamW: ", name, " = ", value, " is invalid; it must be ", rule,
                          ". Fix the optimizer settings.");
  };
  ANVIL_CHECK(std::isfinite(c.lr) && c.lr >= 0, bad("lr", c.lr, "a finite number >= 0"));
  ANVIL_CHECK(c.beta1 >= 0 && c.beta1 < 1, bad("beta1", c.beta1, "in [0, 1)"));
  ANVIL_CHECK(c.beta2 >= 0 && c.beta2 < 1, bad("beta2", c.beta2, "in [0, 1)"));
  ANVIL_CHECK(std::isfinite(c.eps) && c.eps > 0, bad("eps", c.eps, "a finite number > 0"));
  ANVIL_CHECK(std::isfinite(c.weight_decay) && c.weight_decay >= 0,
              bad("weight_decay", c.weight_decay, "a finite number >= 0"));
}

void adamw_step(const AdamWConfig& cfg, int64_t step, Tensor& p, const Tensor& g, Tensor& m, Tensor& v,
                Tensor* p_bf16, float grad_scale) {
  const ScopedOpTime op("adamw");
  check_adamw_config(cfg);
  ANVIL_CHECK(step >= 1, "AdamW: step = ", step, " is invalid; steps are counted from 1 (the bias correction ",
              "divides by 1 - beta^step). Pass the number of this optimizer step, starting at 1.");
  ANVIL_CHECK(std::isfinite(grad_scale), "AdamW: grad_scale = ", grad_scale,
              " is not finite (a NaN/Inf gradient norm?). Stop or skip the step instead of updating the weights.");
  const int64_t n = p.numel();
  check_f32(p, n, "p");
  check_f32(g, n, "g");
  check_f32(m, n, "m");
  check_f32(v, n, "v");
  if (p_bf16) {
    ANVIL_ASSERT(p_bf16->dtype() == DType::bf16, "adamw: the compute copy must be bf16, got ",
                 dtype_name(p_bf16->dtype()));
    ANVIL_ASSERT(p_bf16->numel() == n, "adamw: the compute copy has ", p_bf16->numel(), " elements, p has ", n);
  }

  if (on_gpu("adamw", p, g, m, v)) {
    if (p_bf16) check_same_device("adamw", p, *p_bf16);
    if (n == 0 || dry_run()) return;
    return gpu_kernels("adamw").adamw_step(cfg, step, static_cast<float*>(p.raw()), static_cast<const float*>(g.raw()),
                                           static_cast<float*>(m.raw()), static_cast<float*>(v.raw()),
                                           p_bf16 ? static_cast<uint16_t*>(p_bf16->raw()) : nullptr, n, grad_scale);
  }
  if (dry_run()) return;
  const AdamWCoeffs c = adamw_coeffs(cfg, step, grad_scale);
  float* pp = p.data<float>();
  const float* gp = g.data<float>();
  float* mp = m.data<float>();
  float* vp = v.data<float>();
  bf16* bp = p_bf16 ? p_bf16->data<bf16>() : nullptr;
  parallel_for(0, n, kGrain, [&](int64_t lo, int64_t hi) {
    if (bp)
      adamw_range<true>(c, pp, gp, mp, vp, bp, lo, hi);
    else
      adamw_range<false>(c, pp, gp, mp, vp, bp, lo, hi);
  });
}

}  // namespace anvil
