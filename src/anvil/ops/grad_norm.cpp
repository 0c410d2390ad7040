#include "anvil/ops/grad_norm.h"

#include <algorithm>
#include <limits>
#include <vector>

#include "anvil/core/dry_run.h"
#include "anvil/core/op_timer.h"
#include "anvil/core/parallel_for.h"
#include "anvil/ops/cuda/grad_norm_body.h"  // the GPU kernel's block count (plain C++)
#include "anvil/ops/gpu_kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define ANVIL_GRAD_NORM_AVX512 1
#endif

namespace anvil {

namespace {

constexpr int64_t kGrain = 1 << 16;  // elements per thread at least

#ifdef ANVIL_GRAD_NORM_AVX512

inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << remaining) - 1u);
}

// Squares are exact in double (24-bit significands), so only the additions round.
// Masked-off lanes load as zero and add nothing.
double sum_squares(const float* x, int64_t n) {
  __m512d acc0 = _mm512_setzero_pd(), acc1 = _mm512_setzero_pd();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = tail_mask(n - i);
    const __m512d lo = _mm512_cvtps_pd(_mm256_maskz_loadu_ps(static_cast<__mmask8>(k), x + i));
    const __m512d hi = _mm512_cvtps_pd(_mm256_maskz_loadu_ps(static_cast<__mmask8>(k >> 8), x + i + 8));
    acc0 = _mm512_fmadd_pd(lo, lo, acc0);
    acc1 = _mm512_fmadd_pd(hi, hi, acc1);
  }
  return _mm512_reduce_add_pd(_mm512_add_pd(acc0, acc1));
}

inline __m256 bf16x8_to_f32(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }

double sum_squares(const bf16* x, int64_t n) {
  __m512d acc0 = _mm512_setzero_pd(), acc1 = _mm512_setzero_pd();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = tail_mask(n - i);
    const __m256i h = _mm256_maskz_loadu_epi16(k, x + i);
    const __m512d lo = _mm512_cvtps_pd(bf16x8_to_f32(_mm256_castsi256_si128(h)));
    const __m512d hi = _mm512_cvtps_pd(bf16x8_to_f32(_mm256_extracti128_si256(h, 1)));
    acc0 = _mm512_fmadd_pd(lo, lo, acc0);
    acc1 = _mm512_fmadd_pd(hi, hi, acc1);
  }
  return _mm512_reduce_add_pd(_mm512_add_pd(acc0, acc1));
}

void scale(float* x, int64_t n, float s) {
  const __m512 sv = _mm512_set1_ps(s);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = tail_mask(n - i);
    _mm512_mask_storeu_ps(x + i, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), sv));
  }
}

void scale(bf16* x, int64_t n, float s) {
  const __m512 sv = _mm512_set1_ps(s);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = tail_mask(n - i);
    const __m512 f = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, x + i)), 16));
    const __m512 y = _mm512_mul_ps(f, sv);
    // Round to nearest even, bit for bit as bf16::from_float (NaN kept quiet).
    const __m512i u = _mm512_castps_si512(y);
    const __m512i top = _mm512_srli_epi32(u, 16);
    const __m512i lsb = _mm512_and_si512(top, _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), _mm512_or_si512(top, _mm512_set1_epi32(0x40)));
    _mm256_mask_storeu_epi16(x + i, k, _mm512_cvtepi32_epi16(r));
  }
}

#else  // portable fallback

template <class T>
double sum_squares(const T* x, int64_t n) {
  double acc = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double v = to_f32(x[i]);
    acc += v * v;
  }
  return acc;
}

template <class T>
void scale(T* x, int64_t n, float s) {
  for (int64_t i = 0; i < n; ++i) x[i] = from_f32<T>(to_f32(x[i]) * s);
}

#endif

void check_grad(const Tensor& t) {
  ANVIL_ASSERT(t.defined(), "grad_norm: undefined gradient tensor in the list");
  ANVIL_ASSERT(t.dtype() == DType::f32 || t.dtype() == DType::bf16, "grad_norm: gradients are f32 or bf16, got ",
               dtype_name(t.dtype()));
}

// Splits the concatenation of all tensors' elements into `parts` contiguous,
// equal ranges and calls fn(part, tensor, lo, hi) for every piece of a tensor
// [lo, hi) that falls into a part. One parallel region for the whole list, so
// many small tensors cost no more than one big one. Returns the number of
// parts (at most num_threads()).
template <class F>
int for_each_piece(std::span<const Tensor> grads, F&& fn) {
  int64_t total = 0;
  for (const Tensor& t : grads) total += t.numel();
  const int parts = static_cast<int>(std::clamp<int64_t>(total / kGrain, 1, num_threads()));
  parallel_for(0, parts, 1, [&](int64_t part_lo, int64_t part_hi) {
    for (int64_t part = part_lo; part < part_hi; ++part) {
      const int64_t a = total * part / parts, b = total * (part + 1) / parts;
      int64_t offset = 0;  // of the current tensor in the concatenation
      for (const Tensor& t : grads) {
        const int64_t lo = std::max(a, offset), hi = std::min(b, offset + t.numel());
        if (lo < hi) fn(static_cast<int>(part), t, lo - offset, hi - offset);
        offset += t.numel();
        if (offset >= b) break;
      }
    }
  });
  return parts;
}

}  // namespace

namespace {
// On a GPU: each tensor's Σ x² into its own double on the device, in one
// kernel per tensor (its order fixed by the tensor's size alone), then one
// copy to the host, where they are added in the tensors' order: the step's
// one read of the norm.
double gpu_sum_of_squares(std::span<const Tensor> grads) {
  const Device device = grads[0].device();
  for (const Tensor& t : grads) check_same_device("grad_norm", grads[0], t);
  const auto n = static_cast<int64_t>(grads.size());
  // Doubles in f32 storage (two floats each): the per-tensor sums and the kernel's block partials.
  Tensor sums = Tensor::empty({2 * n}, DType::f32, MemCategory::workspace, "grad_norm.sums", device);
  const Tensor partials = Tensor::empty({2 * int64_t{kernel::kGradNormMaxBlocks}}, DType::f32,
                                        MemCategory::workspace, "grad_norm.partials", device);
  if (dry_run()) return 0.0;
  GpuKernels& k = gpu_kernels("grad_norm");
  sums.zero_();  // an empty tensor's sum is 0
  for (int64_t i = 0; i < n; ++i) {
    const Tensor& t = grads[static_cast<size_t>(i)];
    if (t.numel() == 0) continue;
    k.grad_sum_of_squares(t.dtype(), t.raw(), t.numel(), static_cast<double*>(partials.raw()),
                          static_cast<double*>(sums.raw()) + i);
  }
  const Tensor host = sums.to(Device::cpu(), MemCategory::workspace, "grad_norm.sums");
  const auto* s = reinterpret_cast<const double*>(host.data<float>());
  double total = 0;
  for (int64_t i = 0; i < n; ++i) total += s[i];
  return total;
}
}  // namespace

double grad_sum_of_squares(std::span<const Tensor> grads) {
  const ScopedOpTime op("grad_norm");
  for (const Tensor& t : grads) check_grad(t);
  if (!grads.empty() && !grads[0].device().is_cpu()) return gpu_sum_of_squares(grads);
  if (dry_run()) return 0.0;  // a dry run's gradients are no values: its norm is 0
  // One slot per part, summed below in part order: reproducible for a given thread count.
  std::vector<double> partial(static_cast<size_t>(num_threads()), 0.0);
  const int parts = for_each_piece(grads, [&](int part, const Tensor& t, int64_t lo, int64_t hi) {
    const double s = t.dtype() == DType::f32 ? sum_squares(t.data<float>() + lo, hi - lo)
                                             : sum_squares(t.data<bf16>() + lo, hi - lo);
    partial[static_cast<size_t>(part)] += s;
  });
  double sum = 0;
  for (int i = 0; i < parts; ++i) sum += partial[static_cast<size_t>(i)];
  return sum;
}

double clip_coefficient(double total_norm, double max_norm) {
  ANVIL_CHECK(std::isfinite(max_norm) && max_norm > 0, "gradient clipping: max_norm = ", max_norm,
              " is invalid; it must be a finite number > 0. Fix the clipping setting (or disable clipping).");
  if (!std::isfinite(total_norm)) return std::numeric_limits<double>::quiet_NaN();
  return std::min(1.0, max_norm / (total_norm + 1e-6));
}

void scale_grads_(std::span<const Tensor> grads, float s) {
  const ScopedOpTime op("scale_grads");
  for (const Tensor& t : grads) check_grad(t);
  if (!grads.empty() && !grads[0].device().is_cpu()) {
    for (const Tensor& t : grads) check_same_device("scale_grads", grads[0], t);
    if (dry_run()) return;
    for (const Tensor& t : grads)
      if (t.numel() > 0) gpu_kernels("scale_grads").scale_grads(t.dtype(), t.raw(), t.numel(), s);
    return;
  }
  if (dry_run()) return;
  for_each_piece(grads, [&](int, const Tensor& t, int64_t lo, int64_t hi) {
    if (t.dtype() == DType::f32)
      scale(t.data<float>() + lo, hi - lo, s);
    else
      scale(t.data<bf16>() + lo, hi - lo, s);
  });
}

double clip_grad_norm_(std::span<const Tensor> grads, double max_norm) {
  clip_coefficient(1.0, max_norm);  // rejects a bad max_norm before the pass over the gradients
  const double norm = grad_norm_from_sum_of_squares(grad_sum_of_squares(grads));
  const double coef = clip_coefficient(norm, max_norm);  // NaN when norm is not finite
  if (coef < 1.0) scale_grads_(grads, static_cast<float>(coef));
  return norm;
}

}  // namespace anvil
