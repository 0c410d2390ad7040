// GCC 12 reports its own _mm512_reduce_add_ps (in sum_exp below, once sum_exp has two
// callers) as reading an uninitialised value: GCC bug 105593, a false positive fixed in
// GCC 13 (CMakeLists.txt disables -Wmaybe-uninitialized for the same bug). The warning is
// located in the intrinsics header, so it is silenced before that header is included.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif
#include "anvil/ops/cross_entropy.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "anvil/core/dry_run.h"
#include "anvil/core/op_timer.h"
#include "anvil/core/parallel_for.h"
#include "anvil/ops/avx512_math.h"
#include "anvil/ops/cross_entropy_gpu.h"
#include "anvil/ops/gpu_kernels.h"
#include "anvil/ops/matmul.h"

// Design: two passes over the vocabulary for each block of rows.
//   pass 1 (log-sum-exp): for each vocab chunk, logits = x_blk·w_chunkᵀ (gemm, f32 result), then per
//     row an online max / Σexp update and, when the target falls in the chunk, its logit.
//     loss_row = lse − logit[target].
//   pass 2 (gradients): for each vocab chunk, take pass 1's logits (kept) or recompute them, turn them into
//     dlogits = (softmax − onehot)·grad_scale (f32: in place; bf16 mode: converted to bf16 for the AMX
//     products), then dx_blk += dlogits·w_chunk and dw_chunk += dlogitsᵀ·x_blk (gemm accumulate).
// FLOPs: forward 2·M·V·D + dx 2·M·V·D + dw 2·M·V·D = 6·M·V·D when pass 1 keeps every chunk's logits
// of the row block for pass 2 (cross_entropy_blocking: when enough rows fit in
// kCrossEntropyKeptLogitsBytes), else + a recompute of 2·M·V·D = 8·M·V·D, which keeps memory at one
// block × chunk of logits instead of (M, V): a 4096-token batch with a 128k vocabulary would need 2 GB.
// Recomputing, pass 2 walks the chunks in reverse, so it starts with the chunk pass 1 left in the buffer
// and skips that one recompute (with a single chunk, V ≤ vocab_chunk, nothing is recomputed at all).
// (The forward-only variant: 2·M·V·D.)
//
// Parallelism: the matrix products run one at a time, each multi-threaded inside oneDNN on a whole
// block × chunk, so dw_chunk has exactly one writer (race-free without reductions); the element-wise
// softmax work between them is a parallel_for over the rows of the block.

namespace anvil {

namespace {

constexpr int64_t kRowGrain = 4;
// exp of anything below this is computed as exp(kExpMin) ≈ 4e-38: it keeps every result a normal float
// (subnormals can be slow) and is far below anything that changes a sum which contains exp(0) = 1.
constexpr float kExpMin = -86.0f;

#if defined(__AVX512F__)

// 16 floats to 16 bf16, round to nearest even (as bf16::from_float).
inline __m256i to_bf16x16(__m512 v) {
#if defined(__AVX512BF16__)
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
#endif
}

inline __mmask16 tail_mask(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }
#endif

// max of l[0, n)
[[gnu::always_inline]] inline float max_of(const float* l, int64_t n) {
#if defined(__AVX512F__)
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(l + j));
  if (j < n) {
    const __mmask16 k = tail_mask(n - j);
    m = _mm512_mask_max_ps(m, k, m, _mm512_maskz_loadu_ps(k, l + j));
  }
  return _mm512_reduce_max_ps(m);
#else
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) m = std::max(m, l[j]);
  return m;
#endif
}

// Σ exp(l[j] − shift) over [0, n)
[[gnu::always_inline]] inline float sum_exp(const float* l, int64_t n, float shift) {
#if defined(__AVX512F__)
  const __m512 sh = _mm512_set1_ps(shift);
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    s0 = _mm512_add_ps(s0, avx512::exp(_mm512_sub_ps(_mm512_loadu_ps(l + j), sh), kExpMin));
    s1 = _mm512_add_ps(s1, avx512::exp(_mm512_sub_ps(_mm512_loadu_ps(l + j + 16), sh), kExpMin));
  }
  for (; j < n; j += 16) {
    const __mmask16 k = tail_mask(std::min<int64_t>(16, n - j));
    s0 = _mm512_mask_add_ps(s0, k, s0, avx512::exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, l + j), sh), kExpMin));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
#else
  float s = 0;
  for (int64_t j = 0; j < n; ++j) s += std::exp(std::max(l[j] - shift, kExpMin));
  return s;
#endif
}

// (These helpers are forced inline: the fused kernel and the shard kernels both call them, and
// the fused kernel's code must stay as it was with a single caller.)
// One row of dlogits: out[j] = (exp(in[j] − lse) − [j == target])·scale, where target is the
// target's column in this chunk or −1. f32 works in place (out == in); bf16 writes a separate buffer.
template <class T>
[[gnu::always_inline]] inline void dlogits_row(const float* in, T* out, int64_t n, float lse, float scale, int64_t target) {
  const float target_logit = target >= 0 ? in[target] : 0.0f;
#if defined(__AVX512F__)
  const __m512 vlse = _mm512_set1_ps(lse), vscale = _mm512_set1_ps(scale);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = tail_mask(std::min<int64_t>(16, n - j));
    const __m512 p = _mm512_mul_ps(avx512::exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, in + j), vlse), kExpMin), vscale);
    if constexpr (std::is_same_v<T, bf16>) {
      _mm256_mask_storeu_epi16(out + j, k, to_bf16x16(p));
    } else {
      _mm512_mask_storeu_ps(out + j, k, p);
    }
  }
#else
  for (int64_t j = 0; j < n; ++j) out[j] = from_f32<T>(std::exp(std::max(in[j] - lse, kExpMin)) * scale);
#endif
  if (target >= 0) out[target] = from_f32<T>((std::exp(target_logit - lse) - 1.0f) * scale);
}

// Both entry points. dx == nullptr: forward only.
CrossEntropyResult run(const Tensor& x, const Tensor& w, const Tensor& targets, const CrossEntropyOptions& opt,
                       float grad_scale, Tensor* dx, Tensor* dw) {
  ANVIL_ASSERT(x.ndim() == 2 && w.ndim() == 2 && targets.ndim() == 1, "cross_entropy: x ", shape_str(x.shape()),
               " w ", shape_str(w.shape()), " targets ", shape_str(targets.shape()));
  const int64_t M = x.size(0), D = x.size(1), V = w.size(0);
  ANVIL_ASSERT(w.size(1) == D && targets.size(0) == M && D > 0, "cross_entropy: x ", shape_str(x.shape()), " w ",
               shape_str(w.shape()), " targets ", shape_str(targets.shape()));
  ANVIL_ASSERT(x.dtype() == w.dtype() && x.dtype() != DType::i32 && targets.dtype() == DType::i32,
               "cross_entropy: x ", dtype_name(x.dtype()), " w ", dtype_name(w.dtype()), " targets ",
               dtype_name(targets.dtype()));
  if (on_gpu("cross_entropy", x, w, targets)) return cross_entropy_gpu(x, w, targets, opt, grad_scale, dx, dw);
  const bool backward = dx != nullptr;
  if (backward) {
    ANVIL_ASSERT(dw != nullptr && dx->shape() == x.shape() && dw->shape() == w.shape() &&
                     dx->dtype() != DType::i32 && dw->dtype() != DType::i32,
                 "cross_entropy: dx ", shape_str(dx->shape()), " dw ", shape_str(dw->shape()));
  }
  ANVIL_ASSERT(opt.row_block >= 0 && opt.vocab_chunk >= 0, "cross_entropy: negative block sizes");

  // Validate every target before writing anything, so a bad batch leaves dx and dw untouched.
  const int32_t ignore = opt.ignore_index;
  const int32_t* tgt = targets.data<int32_t>();
  const bool dry = dry_run();
  CrossEntropyResult result;
  result.num_tokens = count_targets(targets, V, ignore);
  if (result.num_tokens == 0) {  // nothing to learn from: zero loss, zero dx, dw unchanged
    if (backward) dx->zero_();
    return result;
  }

  const DType dt = x.dtype();
  const size_t esz = dtype_size(dt);
  const CrossEntropyBlocking blocking = cross_entropy_blocking(M, V, backward, opt);
  const int64_t B = blocking.rows, C = blocking.chunk;
  const int64_t n_chunks = (V + C - 1) / C;
  const bool keep = blocking.keep_logits;

  // Workspace, allocated once per call:
  // - the f32 logits of one block × chunk, or of one block × every chunk when they are kept. Every
  //   chunk's matrices are stored densely (row stride Cn, the chunk's own width; a kept chunk c at
  //   c·C·Bn): oneDNN 2.6 leaves AMX for a slower kernel when an operand is strided.
  // - in bf16 mode the bf16 dlogits of one block × chunk (the AMX operand of the two gradient
  //   products); in f32 mode dlogits overwrite the logits in place.
  // - four per-row stats, and for a bf16 dx an f32 accumulator of the block's dx (summing V/C chunk
  //   products into bf16 would round once per chunk).
  Tensor logits = Tensor::empty({B, keep ? V : C}, DType::f32, MemCategory::workspace, "cross_entropy.logits");
  Tensor stats = Tensor::empty({4, B}, DType::f32, MemCategory::workspace, "cross_entropy.row_stats");
  Tensor dlogits_bf16, dx_acc;
  if (backward && dt == DType::bf16)
    dlogits_bf16 = Tensor::empty({B, C}, DType::bf16, MemCategory::workspace, "cross_entropy.dlogits");
  if (backward && dx->dtype() == DType::bf16)
    dx_acc = Tensor::empty({B, D}, DType::f32, MemCategory::workspace, "cross_entropy.dx_f32");

  float* const logits_base = logits.data<float>();
  float* L = logits_base;                 // the current chunk's logits
  float* row_max = stats.data<float>();   // running max of the logits seen so far
  float* row_sum = row_max + B;           // running Σ exp(logit − row_max)
  float* row_lse = row_max + 2 * B;       // log Σ exp(logit), after pass 1
  float* row_target = row_max + 3 * B;    // the target's logit
  const char* xp = static_cast<const char*>(x.raw());
  const char* wp = static_cast<const char*>(w.raw());
  // logits (Bn, Cn) = x[r0 : r0+Bn] · w[v0 : v0+Cn]ᵀ, f32, into L
  auto compute_logits = [&](int64_t r0, int64_t Bn, int64_t v0, int64_t Cn) {
    GemmShape s{.M = Bn, .N = Cn, .K = D, .trans_b = true, .ab = dt, .c = DType::f32};
    gemm(s, xp + r0 * D * esz, wp + v0 * D * esz, L);
  };

  for (int64_t r0 = 0; r0 < M; r0 += B) {
    const int64_t Bn = std::min(B, M - r0);
    const int32_t* t = tgt + r0;
    if (!dry_run() && std::all_of(t, t + Bn, [&](int32_t id) { return id == ignore; })) {
      if (backward) {
        Tensor rows = dx->slice(r0, Bn);
        rows.zero_();
      }
      continue;
    }

    // ---- pass 1: online log-sum-exp over the vocabulary chunks ----
    // (A dry run makes the block's products, and computes nothing: parallel_for runs no body.)
    if (!dry_run()) {
      std::fill(row_max, row_max + Bn, -std::numeric_limits<float>::infinity());
      std::fill(row_sum, row_sum + Bn, 0.0f);
    }
    for (int64_t c = 0; c < n_chunks; ++c) {
      const int64_t v0 = c * C, Cn = std::min(C, V - v0);
      if (keep) L = logits_base + v0 * Bn;
      compute_logits(r0, Bn, v0, Cn);
      parallel_for(0, Bn, kRowGrain, [&](int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; ++i) {
          if (t[i] == ignore) continue;
          const float* l = L + i * Cn;
          const float m = std::max(row_max[i], max_of(l, Cn));
          // exp(−inf) = 0 on the first chunk, where row_sum is still 0.
          row_sum[i] = row_sum[i] * std::exp(row_max[i] - m) + sum_exp(l, Cn, m);
          row_max[i] = m;
          if (t[i] >= v0 && t[i] < v0 + Cn) row_target[i] = l[t[i] - v0];
        }
      });
    }
    double block_loss = 0;
    for (int64_t i = 0; i < Bn && !dry; ++i) {
      if (t[i] == ignore) continue;
      row_lse[i] = row_max[i] + std::log(row_sum[i]);
      block_loss += static_cast<double>(row_lse[i]) - static_cast<double>(row_target[i]);
    }
    result.loss_sum += block_loss;
    if (!backward) continue;

    // ---- pass 2: gradients, chunks in reverse (the last chunk's logits are still in L; kept, all are) ----
    float* dx_blk = dx->dtype() == DType::f32 ? dx->data<float>() + r0 * D : dx_acc.data<float>();
    char* dwp = static_cast<char*>(dw->raw());
    const size_t dw_esz = dtype_size(dw->dtype());
    for (int64_t c = n_chunks - 1; c >= 0; --c) {
      const int64_t v0 = c * C, Cn = std::min(C, V - v0);
      if (keep) L = logits_base + v0 * Bn;
      else if (c != n_chunks - 1) compute_logits(r0, Bn, v0, Cn);
      // dlogits (Bn, Cn), dense: in place over the logits (f32) or in their own buffer (bf16).
      void* DL = dlogits_bf16.defined() ? dlogits_bf16.raw() : static_cast<void*>(L);
      parallel_for(0, Bn, kRowGrain, [&](int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; ++i) {
          const float* in = L + i * Cn;
          if (t[i] == ignore) {
            std::memset(static_cast<char*>(DL) + i * Cn * esz, 0, static_cast<size_t>(Cn) * esz);
            continue;
          }
          const int64_t target = (t[i] >= v0 && t[i] < v0 + Cn) ? t[i] - v0 : -1;
          if (dt == DType::bf16)
            dlogits_row(in, static_cast<bf16*>(DL) + i * Cn, Cn, row_lse[i], grad_scale, target);
          else
            dlogits_row(in, static_cast<float*>(DL) + i * Cn, Cn, row_lse[i], grad_scale, target);
        }
      });
      // dx_blk (Bn, D) (+)= dlogits (Bn, Cn) · w_chunk (Cn, D); the first chunk overwrites.
      GemmShape sdx{.M = Bn, .N = D, .K = Cn, .ab = dt, .c = DType::f32, .accumulate = c != n_chunks - 1};
      gemm(sdx, DL, wp + v0 * D * esz, dx_blk);
      // dw_chunk (Cn, D) += dlogitsᵀ (Cn, Bn) · x_blk (Bn, D)
      GemmShape sdw{.M = Cn, .N = D, .K = Bn, .trans_a = true, .ab = dt, .c = dw->dtype(), .accumulate = true};
      gemm(sdw, DL, xp + r0 * D * esz, dwp + v0 * D * dw_esz);
    }
    if (dx->dtype() == DType::bf16 && !dry_run()) convert_f32_to_bf16(dx_blk, dx->data<bf16>() + r0 * D, Bn * D);
  }
  return result;
}

// ---- loss parallel (vocabulary shards) ----

// Shapes and dtypes shared by the shard kernels; w may have no rows.
void check_shard_operands(const Tensor& x, const Tensor& w, const Tensor& targets, const char* what) {
  ANVIL_ASSERT(x.ndim() == 2 && w.ndim() == 2 && targets.ndim() == 1 && w.size(1) == x.size(1) &&
                   targets.size(0) == x.size(0) && x.size(1) > 0,
               what, ": x ", shape_str(x.shape()), " w ", shape_str(w.shape()), " targets ",
               shape_str(targets.shape()));
  ANVIL_ASSERT(x.dtype() == w.dtype() && x.dtype() != DType::i32 && targets.dtype() == DType::i32, what, ": x ",
               dtype_name(x.dtype()), " w ", dtype_name(w.dtype()), " targets ", dtype_name(targets.dtype()));
  ANVIL_CHECK(!on_gpu(what, x, w, targets), what,
              ": the loss-parallel head (tensor parallelism) does not run on a GPU yet; a GPU trains one process");
}

// The FLOPs the model's count credits for the head's products: 2·M·V·D each
// (forward; backward dx and dw), whatever is recomputed.
double head_flops(const Tensor& x, const Tensor& w, double per_element) {
  return per_element * static_cast<double>(x.size(0)) * static_cast<double>(w.size(0)) * static_cast<double>(x.size(1));
}

// One row's online log-sum-exp update over a chunk of n logits: (max, Σ exp(l − max)).
void online_lse_update(const float* l, int64_t n, float& max, float& sum) {
  const float m = std::max(max, max_of(l, n));
  sum = sum * std::exp(max - m) + sum_exp(l, n, m);  // exp(−inf) = 0 on the first chunk
  max = m;
}

// logits (Bn, Cn) = x[r0 : r0+Bn] · w[v0 : v0+Cn]ᵀ in f32, densely into L (see run()).
void shard_logits(const Tensor& x, const Tensor& w, int64_t r0, int64_t Bn, int64_t v0, int64_t Cn, float* L) {
  const int64_t D = x.size(1);
  const size_t esz = dtype_size(x.dtype());
  GemmShape s{.M = Bn, .N = Cn, .K = D, .trans_b = true, .ab = x.dtype(), .c = DType::f32};
  gemm(s, static_cast<const char*>(x.raw()) + r0 * D * esz, static_cast<const char*>(w.raw()) + v0 * D * esz, L);
}

}  // namespace

CrossEntropyBlocking cross_entropy_blocking(int64_t M, int64_t V, bool backward, const CrossEntropyOptions& opt) {
  CrossEntropyBlocking b;
  b.chunk = std::max<int64_t>(1, std::min(opt.vocab_chunk > 0 ? opt.vocab_chunk : kCrossEntropyVocabChunk, V));
  const int64_t rows = std::max<int64_t>(1, std::min(opt.row_block > 0 ? opt.row_block : kCrossEntropyRowBlock, M));
  // The rows whose logits over the whole vocabulary fit the budget, at most the default block.
  const int64_t kept_rows = std::min(rows, kCrossEntropyKeptLogitsBytes / (4 * std::max<int64_t>(1, V)));
  switch (opt.keep_logits) {
    case KeepLogits::keep: b.keep_logits = backward; break;
    case KeepLogits::recompute: b.keep_logits = false; break;
    case KeepLogits::automatic:
      b.keep_logits = backward && V > b.chunk && kept_rows >= std::min(M, kCrossEntropyKeptRowsMin);
      break;
  }
  b.rows = b.keep_logits && opt.keep_logits == KeepLogits::automatic ? kept_rows : rows;
  return b;
}

CrossEntropyBlocking cross_entropy_shard_blocking(int64_t M, int64_t V, const CrossEntropyOptions& opt) {
  CrossEntropyOptions recompute = opt;
  recompute.keep_logits = KeepLogits::recompute;
  return cross_entropy_blocking(M, V, /*backward=*/true, recompute);
}

int64_t count_targets(const Tensor& targets, int64_t V, int32_t ignore_index) {
  const int64_t M = targets.numel();
  // A dry run has no targets: every row counts (no padding), as in training on packed windows.
  if (dry_run()) return M;
  const int32_t* tgt = targets.data<int32_t>();
  int64_t counted = 0;
  for (int64_t i = 0; i < M; ++i) {
    if (tgt[i] == ignore_index) continue;
    ANVIL_CHECK(tgt[i] >= 0 && tgt[i] < V, "cross_entropy: target id ", tgt[i], " at row ", i,
                " is outside the vocabulary [0, ", V, ") and is not the ignore_index (", ignore_index,
                "); check that the tokenizer's vocabulary fits the model's vocab_size and that padding "
                "positions use the ignore_index");
    ++counted;
  }
  return counted;
}

CrossEntropyResult cross_entropy_forward(const Tensor& x, const Tensor& w, const Tensor& targets,
                                         const CrossEntropyOptions& opt) {
  const ScopedOpTime op("cross_entropy.forward", head_flops(x, w, 2));
  return run(x, w, targets, opt, 0.0f, nullptr, nullptr);
}

CrossEntropyResult cross_entropy_forward_backward(const Tensor& x, const Tensor& w, const Tensor& targets,
                                                  float grad_scale, Tensor& dx, Tensor& dw,
                                                  const CrossEntropyOptions& opt) {
  const ScopedOpTime op("cross_entropy.forward_backward", head_flops(x, w, 6));
  return run(x, w, targets, opt, grad_scale, &dx, &dw);
}

int64_t cross_entropy_shard_stats(const Tensor& x, const Tensor& w, const Tensor& targets, int64_t vocab_begin,
                                  int64_t vocab_size, Tensor& stats, const CrossEntropyOptions& opt) {
  check_shard_operands(x, w, targets, "cross_entropy_shard_stats");
  const ScopedOpTime op("cross_entropy.shard_stats", head_flops(x, w, 2));
  const int64_t M = x.size(0), V = w.size(0);
  ANVIL_ASSERT(stats.dtype() == DType::f32 && stats.numel() == 3 * M && vocab_begin >= 0 &&
                   vocab_begin + V <= vocab_size,
               "cross_entropy_shard_stats: stats ", shape_str(stats.shape()), ", rows [", vocab_begin, ", ",
               vocab_begin + V, ") of ", vocab_size);
  const int32_t ignore = opt.ignore_index;
  const int32_t* tgt = targets.data<int32_t>();
  const int64_t counted = count_targets(targets, vocab_size, ignore);  // against the whole vocabulary
  float* row_max = stats.data<float>();
  float* row_sum = row_max + M;
  float* row_target = row_max + 2 * M;
  if (!dry_run()) {
    std::fill(row_max, row_max + M, -std::numeric_limits<float>::infinity());
    std::fill(row_sum, row_sum + 2 * M, 0.0f);
  }
  if (counted == 0 || V == 0) return counted;

  const CrossEntropyBlocking blocking = cross_entropy_shard_blocking(M, V, opt);
  const int64_t B = blocking.rows, C = blocking.chunk;
  Tensor logits = Tensor::empty({B, C}, DType::f32, MemCategory::workspace, "cross_entropy.logits");
  float* L = logits.data<float>();
  for (int64_t r0 = 0; r0 < M; r0 += B) {
    const int64_t Bn = std::min(B, M - r0);
    const int32_t* t = tgt + r0;
    if (!dry_run() && std::all_of(t, t + Bn, [&](int32_t id) { return id == ignore; })) continue;
    float *mx = row_max + r0, *sm = row_sum + r0, *tg = row_target + r0;
    for (int64_t v0 = 0; v0 < V; v0 += C) {
      const int64_t Cn = std::min(C, V - v0);
      shard_logits(x, w, r0, Bn, v0, Cn, L);
      const int64_t first = vocab_begin + v0;  // the chunk's first global vocabulary id
      parallel_for(0, Bn, kRowGrain, [&](int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; ++i) {
          if (t[i] == ignore) continue;
          const float* l = L + i * Cn;
          online_lse_update(l, Cn, mx[i], sm[i]);
          if (t[i] >= first && t[i] < first + Cn) tg[i] = l[t[i] - first];
        }
      });
    }
  }
  return counted;
}

void cross_entropy_rescale_sumexp(Tensor& stats, const Tensor& global_max, const Tensor& targets,
                                  const CrossEntropyOptions& opt) {
  const int64_t M = targets.numel();
  ANVIL_ASSERT(stats.dtype() == DType::f32 && stats.numel() == 3 * M && global_max.dtype() == DType::f32 &&
                   global_max.numel() == M && targets.dtype() == DType::i32,
               "cross_entropy_rescale_sumexp: stats ", shape_str(stats.shape()), " max ",
               shape_str(global_max.shape()));
  if (dry_run()) return;
  const float* mx = stats.data<float>();
  float* sm = stats.data<float>() + M;
  const float* g = global_max.data<float>();
  const int32_t* t = targets.data<int32_t>();
  for (int64_t i = 0; i < M; ++i) {
    // An empty shard's Σ is 0 and its max −inf: 0·exp(−inf) = 0, as it should.
    sm[i] = t[i] == opt.ignore_index ? 0.0f : sm[i] * std::exp(mx[i] - g[i]);
  }
}

CrossEntropyResult cross_entropy_combine_rows(const Tensor& global_max, const Tensor& summed_stats,
                                              const Tensor& targets, Tensor& lse, const CrossEntropyOptions& opt) {
  const int64_t M = targets.numel();
  ANVIL_ASSERT(summed_stats.dtype() == DType::f32 && summed_stats.numel() == 3 * M &&
                   global_max.dtype() == DType::f32 && global_max.numel() == M && lse.dtype() == DType::f32 &&
                   lse.numel() == M,
               "cross_entropy_combine_rows: stats ", shape_str(summed_stats.shape()));
  const float* g = global_max.data<float>();
  const float* sum = summed_stats.data<float>() + M;
  const float* target_logit = summed_stats.data<float>() + 2 * M;
  const int32_t* t = targets.data<int32_t>();
  float* out = lse.data<float>();
  CrossEntropyResult r;
  if (dry_run()) {  // every row counts, as in run()
    r.num_tokens = M;
    return r;
  }
  for (int64_t i = 0; i < M; ++i) {
    if (t[i] == opt.ignore_index) {
      out[i] = 0.0f;
      continue;
    }
    // As the fused kernel: lse = max + log Σ exp(logit − max), in f32; the loss summed in double.
    out[i] = g[i] + std::log(sum[i]);
    r.loss_sum += static_cast<double>(out[i]) - static_cast<double>(target_logit[i]);
    ++r.num_tokens;
  }
  return r;
}

void cross_entropy_shard_backward(const Tensor& x, const Tensor& w, const Tensor& targets, int64_t vocab_begin,
                                  const Tensor& lse, float grad_scale, Tensor& dx, Tensor& dw,
                                  const CrossEntropyOptions& opt) {
  check_shard_operands(x, w, targets, "cross_entropy_shard_backward");
  const ScopedOpTime op("cross_entropy.shard_backward", head_flops(x, w, 4));
  const int64_t M = x.size(0), D = x.size(1), V = w.size(0);
  ANVIL_ASSERT(dx.shape() == x.shape() && dw.shape() == w.shape() && dx.dtype() != DType::i32 &&
                   dw.dtype() != DType::i32 && lse.dtype() == DType::f32 && lse.numel() == M,
               "cross_entropy_shard_backward: dx ", shape_str(dx.shape()), " dw ", shape_str(dw.shape()));
  const int32_t ignore = opt.ignore_index;
  const int32_t* tgt = targets.data<int32_t>();
  if (V == 0) {  // an empty shard adds nothing to dx
    dx.zero_();
    return;
  }
  const DType dt = x.dtype();
  const size_t esz = dtype_size(dt);
  const CrossEntropyBlocking blocking = cross_entropy_shard_blocking(M, V, opt);
  const int64_t B = blocking.rows, C = blocking.chunk;
  // Workspace as in run(): f32 logits of one block × chunk (dlogits in place for f32), a bf16
  // dlogits buffer in bf16 mode, and an f32 accumulator when dx is bf16.
  Tensor logits = Tensor::empty({B, C}, DType::f32, MemCategory::workspace, "cross_entropy.logits");
  Tensor dlogits_bf16, dx_acc;
  if (dt == DType::bf16)
    dlogits_bf16 = Tensor::empty({B, C}, DType::bf16, MemCategory::workspace, "cross_entropy.dlogits");
  if (dx.dtype() == DType::bf16)
    dx_acc = Tensor::empty({B, D}, DType::f32, MemCategory::workspace, "cross_entropy.dx_f32");
  float* L = logits.data<float>();
  void* DL = dlogits_bf16.defined() ? dlogits_bf16.raw() : static_cast<void*>(L);
  const float* row_lse = lse.data<float>();
  const char* xp = static_cast<const char*>(x.raw());
  const char* wp = static_cast<const char*>(w.raw());
  char* dwp = static_cast<char*>(dw.raw());
  const size_t dw_esz = dtype_size(dw.dtype());
  for (int64_t r0 = 0; r0 < M; r0 += B) {
    const int64_t Bn = std::min(B, M - r0);
    const int32_t* t = tgt + r0;
    if (!dry_run() && std::all_of(t, t + Bn, [&](int32_t id) { return id == ignore; })) {
      Tensor rows = dx.slice(r0, Bn);
      rows.zero_();
      continue;
    }
    float* dx_blk = dx.dtype() == DType::f32 ? dx.data<float>() + r0 * D : dx_acc.data<float>();
    for (int64_t v0 = 0; v0 < V; v0 += C) {
      const int64_t Cn = std::min(C, V - v0);
      shard_logits(x, w, r0, Bn, v0, Cn, L);
      const int64_t first = vocab_begin + v0;
      parallel_for(0, Bn, kRowGrain, [&](int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; ++i) {
          if (t[i] == ignore) {
            std::memset(static_cast<char*>(DL) + i * Cn * esz, 0, static_cast<size_t>(Cn) * esz);
            continue;
          }
          const int64_t target = (t[i] >= first && t[i] < first + Cn) ? t[i] - first : -1;
          if (dt == DType::bf16)
            dlogits_row(L + i * Cn, static_cast<bf16*>(DL) + i * Cn, Cn, row_lse[r0 + i], grad_scale, target);
          else
            dlogits_row(L + i * Cn, static_cast<float*>(DL) + i * Cn, Cn, row_lse[r0 + i], grad_scale, target);
        }
      });
      // dx_blk (Bn, D) (+)= dlogits (Bn, Cn) · w_chunk (Cn, D); the first chunk overwrites.
      GemmShape sdx{.M = Bn, .N = D, .K = Cn, .ab = dt, .c = DType::f32, .accumulate = v0 != 0};
      gemm(sdx, DL, wp + v0 * D * esz, dx_blk);
      // dw_chunk (Cn, D) += dlogitsᵀ (Cn, Bn) · x_blk (Bn, D)
      GemmShape sdw{.M = Cn, .N = D, .K = Bn, .trans_a = true, .ab = dt, .c = dw.dtype(), .accumulate = true};
      gemm(sdw, DL, xp + r0 * D * esz, dwp + v0 * D * dw_esz);
    }
    if (dx.dtype() == DType::bf16 && !dry_run()) convert_f32_to_bf16(dx_blk, dx.data<bf16>() + r0 * D, Bn * D);
  }
}

}  // namespace anvil
