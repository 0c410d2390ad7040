// Causal grouped-query attention, flash-attention style (see attention.h).
//
// Forward, per (batch, query head, query tile Q_i of Bq rows), over key tiles
// K_j/V_j of Bk keys up to the diagonal:
//   S = scale · Q_i K_jᵀ                        (gemm, f32)
//   online softmax: m' = max(m, rowmax S), P = exp(S − m'),
//   l = l·e^(m−m') + rowsum P, O = O·e^(m−m')
//   O += P V_j                                   (gemm, P in the storage dtype)
// then out = O / l and lse = m + log l.
//
// Backward, with Δ = rowsum(dout ∘ out) precomputed per query row:
//   S = scale · Q_i K_jᵀ, P = exp(S − lse)       (recomputed, never stored whole)
//   dP = dO_i V_jᵀ, dS = P ∘ (dP − Δ) · scale
//   dV_j += Pᵀ dO_i, dK_j += dSᵀ Q_i, dQ_i += dS K_j
//
// Work is split into tasks of (batch, kv head) over parallel_for; each task
// packs the rows of its heads densely (see "Packing"), then every tile product
// is anvil::gemm called inside the parallel region, so it runs single-threaded
// on the calling thread: in bf16 on AMX, with the softmax in f32 and P, dS
// rounded to bf16 only as gemm inputs. This relies on gemm() being safe when
// several threads run the same cached oneDNN primitive at once, which needs a
// scratchpad per calling thread (oneDNN's library-managed one is shared).
// Scores are kept in log2 units (log2 e folded into the products' alpha) so
// the exponentials are 2^x; lse is stored as a natural log.
#include "anvil/ops/attention.h"

#include <algorithm>
#include <vector>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>

#include <numeric>
#include <set>
#include <type_traits>

#include "anvil/core/dry_run.h"
#include "anvil/core/op_timer.h"
#include "anvil/core/parallel_for.h"
#include "anvil/ops/attention_gpu.h"
#include "anvil/ops/matmul.h"

namespace anvil {


namespace {

struct Dims {
  int64_t B, Tq, Tk, Hq, Hkv, D;
  int64_t group;  // query heads per kv head
  float scale;
  int64_t q_first, k_first;  // the positions of query row 0 and key row 0 (AttentionWindow)
  // Documents (AttentionWindow::documents): (B, 2, S) i32, or null for one per sequence.
  const int32_t* docs = nullptr;
  int64_t S = 0;
  // Key rows any query sees: those before the last query's position.
  int64_t keys_seen() const { return std::clamp<int64_t>(q_first + Tq - k_first, 0, Tk); }
  // Key rows query row t sees under the causal mask: those up to its position.
  int64_t keys_of(int64_t t) const { return std::min<int64_t>(Tk, q_first + t - k_first + 1); }
  // The first key row query row t of sequence b sees: that of its document's start.
  int64_t first_key_of(int64_t b, int64_t t) const {
    return docs ? std::max<int64_t>(0, docs[b * 2 * S + q_first + t] - k_first) : 0;
  }
  // The query rows after the last that sees key row j of sequence b: those of
  // its document's end (Tq: every later row, causal).
  int64_t query_end_of(int64_t b, int64_t j) const {
    return docs ? std::clamp<int64_t>(docs[(b * 2 + 1) * S + k_first + j] - q_first, 0, Tq) : Tq;
  }
};

Dims attention_dims(const Tensor& q, const Tensor& k, const Tensor& v, float scale, const AttentionWindow& w) {
  ANVIL_ASSERT(q.ndim() == 4 && k.ndim() == 4 && v.ndim() == 4, "attention: q ", shape_str(q.shape()), " k ",
               shape_str(k.shape()), " v ", shape_str(v.shape()), " must be (B, T, heads, head_dim)");
  Dims d{q.size(0), q.size(1), k.size(1), q.size(2), k.size(2), q.size(3), 0, scale, w.q_first, w.k_first};
  ANVIL_ASSERT(k.shape() == v.shape() && k.size(0) == d.B && k.size(3) == d.D, "attention: q ", shape_str(q.shape()),
               " k ", shape_str(k.shape()), " v ", shape_str(v.shape()));
  ANVIL_ASSERT(w.q_first >= w.k_first && w.k_first >= 0, "attention: the queries start at position ", w.q_first,
               ", before the keys (", w.k_first, ")");
  if (w.documents.defined()) {
    const Tensor& docs = w.documents;
    ANVIL_ASSERT(docs.dtype() == DType::i32 && docs.ndim() == 3 && docs.size(0) == d.B && docs.size(1) == 2 &&
                     docs.size(2) >= w.q_first + d.Tq && docs.size(2) >= w.k_first + d.Tk,
                 "attention: documents ", shape_str(docs.shape()), " ", dtype_name(docs.dtype()),
                 " must be i32 (B, 2, S) over sequences holding queries at ", w.q_first, "..", w.q_first + d.Tq,
                 " and keys at ", w.k_first, "..", w.k_first + d.Tk, " for B = ", d.B);
    d.docs = docs.data<int32_t>();
    d.S = docs.size(2);
  }
  ANVIL_CHECK(d.Hkv > 0 && d.Hq % d.Hkv == 0, "attention: ", d.Hq, " query heads cannot be shared evenly by ", d.Hkv,
              " key/value heads (q ", shape_str(q.shape()), ", k ", shape_str(k.shape()),
              "); choose n_kv_heads so that it divides n_heads");
  ANVIL_ASSERT(q.dtype() == k.dtype() && q.dtype() == v.dtype() && q.dtype() != DType::i32,
               "attention: q, k, v must share a float dtype");
  d.group = d.Hq / d.Hkv;
  if (d.scale == 0.0f) d.scale = 1.0f / std::sqrt(static_cast<float>(d.D));
  return d;
}

void check_like(const Tensor& t, const Tensor& like, const char* name) {
  ANVIL_ASSERT(t.shape() == like.shape() && t.dtype() == like.dtype(), "attention: ", name, " ", shape_str(t.shape()),
               " ", dtype_name(t.dtype()), " must match ", shape_str(like.shape()), " ", dtype_name(like.dtype()));
}

void check_lse(const Tensor& lse, int64_t B, int64_t Hq, int64_t T) {
  ANVIL_ASSERT(lse.dtype() == DType::f32 && lse.shape() == Shape({B, Hq, T}), "attention: lse ",
               shape_str(lse.shape()), " must be f32 (B, Hq, T)");
}
void check_lse(const Tensor& lse, const Dims& d) { check_lse(lse, d.B, d.Hq, d.Tq); }

// A GPU's tensors, checked as the CPU's are before the device side takes
// them (which reads no host data: its documents are the device's).
void check_gpu_operands(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse) {
  ANVIL_ASSERT(q.ndim() == 4 && k.ndim() == 4, "attention: q ", shape_str(q.shape()), " k ", shape_str(k.shape()),
               " must be (B, T, heads, head_dim)");
  check_like(v, k, "v");
  check_like(out, q, "out");
  ANVIL_ASSERT(q.dtype() == k.dtype(), "attention: q, k, v must share a float dtype");
  check_lse(lse, q.size(0), q.size(2), q.size(1));
}

// The FLOPs the model's count credits (estimate/flops.cpp, torchtitan's convention): the products as if
// not causal, 4·Tq·Tk·head_dim per query head forward and twice that backward (4·T² over a whole sequence).
double attention_flops(const Dims& d, double per_element) {
  return per_element * static_cast<double>(d.B * d.Hq * d.D) * static_cast<double>(d.Tq) * static_cast<double>(d.Tk);
}

constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2 = 0.693147180559945309f;

// ---- Row kernels: the element-wise part of each block, one row at a time ----
// Written with AVX-512 (16 floats a step, masked tails) because the
// exponential of every score is the largest cost after the products (about a
// quarter of the time in bf16); a plain scalar version keeps non-AVX-512
// builds working.

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>

inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u); }

inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const bf16* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline void store16(float* p, __m512 x, __mmask16 m) { _mm512_mask_storeu_ps(p, m, x); }
inline void store16(bf16* p, __m512 x, __mmask16 m) {
#if defined(__AVX512BF16__)
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(x));  // round to nearest even
#else
  __m512i u = _mm512_castps_si512(x);  // round to nearest even, as bf16::from_float (values are finite)
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
#endif
}

// 2^x for finite x: 2^n · 2^f with n = round(x) and f = x − n in [−½, ½];
// 2^f by a degree-5 polynomial (Chebyshev fit, relative error ≤ 2e-7, about
// 1 ulp). Scores are kept in log2 units (log2 e is folded into the products'
// alpha), which saves the range reduction by ln 2. Underflows to 0.
inline __m512 exp2_16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.34004322e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6760371e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.55032721e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40221074e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93147207e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// max of s[0, n), n ≥ 1. Four accumulators: a single one would chain every
// step on the 4-cycle latency of vmaxps.
inline float row_max(const float* s, int64_t n) {
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 m0 = lowest, m1 = lowest, m2 = lowest, m3 = lowest;
  int64_t j = 0;
  for (; j + 64 <= n; j += 64) {
    m0 = _mm512_max_ps(m0, _mm512_loadu_ps(s + j));
    m1 = _mm512_max_ps(m1, _mm512_loadu_ps(s + j + 16));
    m2 = _mm512_max_ps(m2, _mm512_loadu_ps(s + j + 32));
    m3 = _mm512_max_ps(m3, _mm512_loadu_ps(s + j + 48));
  }
  for (; j < n; j += 16) m0 = _mm512_max_ps(m0, _mm512_mask_loadu_ps(m0, tail_mask(n - j), s + j));
  return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3)));
}

// p[j] = 2^(s[j] − m) for j < n, 0 for n ≤ j < width; returns Σ p in f32
// (two sums, to halve the add latency chain).
template <class P>
inline float exp_row(const float* s, float m, int64_t n, int64_t width, P* p) {
  const __m512 vm = _mm512_set1_ps(m);
  __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 32 <= n; j += 32) {
    const __m512 e0 = exp2_16(_mm512_sub_ps(_mm512_loadu_ps(s + j), vm));
    const __m512 e1 = exp2_16(_mm512_sub_ps(_mm512_loadu_ps(s + j + 16), vm));
    sum0 = _mm512_add_ps(sum0, e0);
    sum1 = _mm512_add_ps(sum1, e1);
    store16(p + j, e0, 0xFFFF);
    store16(p + j + 16, e1, 0xFFFF);
  }
  for (; j < width; j += 16) {
    const __mmask16 valid = j < n ? tail_mask(n - j) : __mmask16(0);
    const __m512 e = _mm512_maskz_mov_ps(valid, exp2_16(_mm512_sub_ps(load16(s + j, valid), vm)));
    sum0 = _mm512_add_ps(sum0, e);
    store16(p + j, e, tail_mask(width - j));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(sum0, sum1));
}

// x[0, n) *= c
inline void scale_row(float* x, float c, int64_t n) {
  const __m512 vc = _mm512_set1_ps(c);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = tail_mask(n - j);
    store16(x + j, _mm512_mul_ps(load16(x + j, k), vc), k);
  }
}

// dst[0, n) = src · c, converted to dst's dtype
template <class T>
inline void store_scaled_row(const float* src, float c, int64_t n, T* dst) {
  const __m512 vc = _mm512_set1_ps(c);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = tail_mask(n - j);
    store16(dst + j, _mm512_mul_ps(load16(src + j, k), vc), k);
  }
}

// Σ a[j]·b[j] over j < n, in f32
template <class T>
inline float dot_row(const T* a, const T* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 k = tail_mask(n - j);
    acc = _mm512_fmadd_ps(load16(a + j, k), load16(b + j, k), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// One row of the transposed backward block (one key, queries along the row):
// for start ≤ i < stop, p = 2^(s − lse[i]) and ds = p·(dp − delta[i])·scale;
// both 0 for the other i < n (queries before the key, masked by causality, and
// from stop on, those of later documents).
template <class P>
inline void grad_row(const float* s, const float* dp, const float* lse, const float* delta, float scale, int64_t start,
                     int64_t stop, int64_t n, P* p, P* ds) {
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = tail_mask(n - i);
    const __mmask16 valid = k & tail_mask(std::clamp<int64_t>(stop - i, 0, 16)) &
                            __mmask16(~tail_mask(std::clamp<int64_t>(start - i, 0, 16)));
    const __m512 e = _mm512_maskz_mov_ps(valid, exp2_16(_mm512_sub_ps(load16(s + i, valid), load16(lse + i, valid))));
    const __m512 g =
        _mm512_mul_ps(_mm512_mul_ps(e, _mm512_sub_ps(load16(dp + i, valid), load16(delta + i, valid))), vscale);
    store16(p + i, e, k);
    store16(ds + i, g, k);
  }
}

#else  // portable fallback

inline float row_max(const float* s, int64_t n) {
  float m = s[0];
  for (int64_t j = 1; j < n; ++j) m = std::max(m, s[j]);
  return m;
}
template <class P>
inline float exp_row(const float* s, float m, int64_t n, int64_t width, P* p) {
  float sum = 0;
  for (int64_t j = 0; j < width; ++j) {
    const float e = j < n ? std::exp2(s[j] - m) : 0.0f;
    sum += e;
    p[j] = from_f32<P>(e);
  }
  return sum;
}
inline void scale_row(float* x, float c, int64_t n) {
  for (int64_t j = 0; j < n; ++j) x[j] *= c;
}
template <class T>
inline void store_scaled_row(const float* src, float c, int64_t n, T* dst) {
  for (int64_t j = 0; j < n; ++j) dst[j] = from_f32<T>(src[j] * c);
}
template <class T>
inline float dot_row(const T* a, const T* b, int64_t n) {
  float acc = 0;
  for (int64_t j = 0; j < n; ++j) acc += to_f32(a[j]) * to_f32(b[j]);
  return acc;
}
template <class P>
inline void grad_row(const float* s, const float* dp, const float* lse, const float* delta, float scale, int64_t start,
                     int64_t stop, int64_t n, P* p, P* ds) {
  for (int64_t i = 0; i < n; ++i) {
    const bool valid = i >= start && i < stop;
    const float e = valid ? std::exp2(s[i] - lse[i]) : 0.0f;
    p[i] = from_f32<P>(e);
    ds[i] = from_f32<P>(valid ? e * (dp[i] - delta[i]) * scale : 0.0f);
  }
}

#endif

// ---- Packing ----
//
// oneDNN 2.6 (Debian's) runs a product on AMX ("brg:avx512_core_amx") only
// when A, B and C are densely packed: with a row stride of Hq·D instead of D
// it falls back to "gemm:jit" without AMX, measured 1.5–5× slower on 128–256
// tiles. So, like flash attention loading tiles into on-chip memory, each task
// first copies the rows of the heads it works on into per-thread dense
// buffers: one extra pass over q/k/v (and dout), 5–9% of the time measured at
// T = 512–2048, far less than the strided products would lose.

// dst (rows, D) = rows t0.. of head h of src (B, Ts, H, D), for batch b;
// widened from bf16 to f32 when the products run in f32 (see attention_forward).
template <class T, class C>
void pack_head(const T* src, const Dims& d, int64_t Ts, int64_t H, int64_t b, int64_t h, int64_t t0, int64_t rows,
               C* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* row = src + ((b * Ts + t0 + r) * H + h) * d.D;
    if constexpr (std::is_same_v<T, C>) {
      std::memcpy(dst + r * d.D, row, size_t(d.D) * sizeof(T));
    } else {
      for (int64_t e = 0; e < d.D; ++e) dst[r * d.D + e] = to_f32(row[e]);
    }
  }
}

// The inverse, converting from f32: rows t0.. of head h of dst (B, Ts, H, D) =
// src (rows, D), or += src when accumulating (added in f32, rounded once).
template <class T>
void unpack_head(const float* src, const Dims& d, int64_t Ts, int64_t H, int64_t b, int64_t h, int64_t t0, int64_t rows,
                 T* dst, bool accumulate = false) {
  for (int64_t r = 0; r < rows; ++r) {
    T* row = dst + ((b * Ts + t0 + r) * H + h) * d.D;
    if (!accumulate) {
      store_scaled_row(src + r * d.D, 1.0f, d.D, row);
      continue;
    }
    for (int64_t e = 0; e < d.D; ++e) row[e] = from_f32<T>(to_f32(row[e]) + src[r * d.D + e]);
  }
}

// Tasks are (batch, kv head, split): a task packs its kv head once and serves
// every query head of the group from it. With B·Hkv a multiple of the thread
// count one split suffices; otherwise each (batch, kv head) is split into
// `threads / gcd` parts so the task count divides evenly over the threads.
// Each thread of the parallel_for takes tasks from a shared counter rather
// than a fixed chunk, so a thread slowed down by other load on the machine
// ends up doing fewer of them.
// At most max_splits (the causal-balanced tile pairs along T).
int64_t task_splits(int64_t owners, int64_t max_splits) {
  const int64_t threads = omp_in_parallel() ? 1 : num_threads();
  if (owners % threads == 0) return 1;
  return std::clamp<int64_t>(threads / std::gcd(owners, threads), 1, std::max<int64_t>(1, max_splits));
}
// The tile along the causal diagonal: at most max(64, T/4), since about half
// a tile of work per block row is masked out.
int64_t diagonal_tile(int64_t tile, int64_t T) { return std::min({tile, std::max<int64_t>(64, T / 4), T}); }

// The tile grids, and which tiles of them run: the kernels and
// attention_tile_count share these, so the count is what the kernels do.
struct Grid {
  int64_t Bq, Bk;
  // The granularity the masked side is cut at: the forward's key blocks start
  // on multiples of it and run up to Bk keys; the backward's query tiles run
  // up to Bq rows but end at most a multiple of it past the last query that
  // sees the key tile. The causal grids' is Bk forward, Bq backward (no cut);
  // the document grid's the document tile.
  int64_t align;
};
// The causal grids, which size the buffers.
Grid forward_grid(const Dims& d, const AttentionTiles& t) {
  const int64_t Bk = std::min(t.fwd_k, std::max<int64_t>(d.keys_seen(), 1));
  return {diagonal_tile(t.fwd_q, d.Tq), Bk, Bk};
}
Grid backward_grid(const Dims& d, const AttentionTiles& t) {
  const int64_t Bq = std::min(t.bwd_q, d.Tq);
  return {Bq, diagonal_tile(t.bwd_k, std::max<int64_t>(d.keys_seen(), 1)), Bq};
}
// The document grid (AttentionTiles::doc), from a causal one, so fewer tiles
// cross a document boundary: the tile along the diagonal (the forward's
// queries, the backward's keys) at most doc, and the masked side cut at
// multiples of doc (align) but run in products as wide as the causal grid's:
// a query tile's keys, or a key tile's queries, are one run from or to a
// document boundary, in fewer, larger products.
Grid document_grid(const Grid& causal, const AttentionTiles& t, bool forward) {
  if (forward) return {std::min(causal.Bq, t.doc), causal.Bk, std::min(causal.Bk, t.doc)};
  return {causal.Bq, std::min(causal.Bk, t.doc), std::min(causal.Bq, t.doc)};
}
// Rows of the backward's query tile at q0, whose key tile's queries end at qend.
int64_t backward_rows(const Grid& g, int64_t Tq, int64_t q0, int64_t qend) {
  return std::min({g.Bq, Tq - q0, (qend - q0 + g.align - 1) / g.align * g.align});
}
// Whether sequence b runs on the document grid: it holds two documents or
// more, of at most 4 document tiles on average. Depends on the data, but the
// grids it picks from do not, so neither does the workspace.
bool short_documents(const Dims& d, int64_t b, const AttentionTiles& t) {
  if (d.docs == nullptr) return false;
  const int32_t* start = d.docs + b * 2 * d.S;
  int64_t n = 0;
  for (int64_t p = 0; p < d.S; ++p) n += start[p] == p;
  return n >= 2 && d.S <= 4 * t.doc * n;
}
// Each sequence's grid, from `causal` (forward_grid or backward_grid). A dry
// run has no documents to read (its tensors are addresses only) and needs no
// grid: what a call allocates does not depend on it.
std::vector<Grid> sequence_grids(const Dims& d, const Grid& causal, const AttentionTiles& t, bool forward) {
  std::vector<Grid> grids(static_cast<size_t>(d.B), causal);
  if (dry_run()) return grids;
  for (int64_t b = 0; b < d.B; ++b)
    if (short_documents(d, b, t)) grids[static_cast<size_t>(b)] = document_grid(causal, t, forward);
  return grids;
}
// The grids a call may run (the causal one, and under documents the document
// grid): every product shape comes from one of them.
std::vector<Grid> candidate_grids(const Dims& d, const Grid& causal, const AttentionTiles& t, bool forward) {
  std::vector<Grid> out{causal};
  const Grid doc = document_grid(causal, t, forward);
  if (d.docs != nullptr && (doc.Bq != causal.Bq || doc.Bk != causal.Bk || doc.align != causal.align))
    out.push_back(doc);
  return out;
}
// The keys [kbeg, kend) the forward's query tile at row q0 of sequence b runs
// over in blocks of g.Bk from kbeg: up to its last query's position (causal),
// from the block holding its first query's document start (kbeg on the grid,
// so the products keep the causal shapes).
std::pair<int64_t, int64_t> forward_keys(const Dims& d, const Grid& g, int64_t b, int64_t q0) {
  const int64_t mq = std::min(g.Bq, d.Tq - q0);
  return {d.first_key_of(b, q0) / g.align * g.align, std::min(d.keys_seen(), d.q_first - d.k_first + q0 + mq)};
}
// The queries [qbeg, qend) the backward's key tile at row k0 of sequence b
// runs over in tiles of g.Bq from qbeg: from the first key's position
// (causal) to the end of the last key's document.
std::pair<int64_t, int64_t> backward_queries(const Dims& d, const Grid& g, int64_t b, int64_t k0) {
  const int64_t nk = std::min(g.Bk, d.keys_seen() - k0);
  return {std::max<int64_t>(0, k0 - (d.q_first - d.k_first)), d.query_end_of(b, k0 + nk - 1)};
}
// The threads a call runs its tasks on, each with its own slot of scratch. The
// scratch of every slot is allocated before the threads start, so the peak is
// the same whichever threads the OS happens to run first (the memory
// estimator's bound is reached on every run, not only when all threads start
// together).
// oneDNN's scratchpads of the tile products, `bytes` (rounded to 64) per slot.
class TileScratch {
 public:
  TileScratch(int64_t slots, size_t bytes, const char* tag) : stride_((bytes + 63) / 64 * 64) {
    if (stride_ > 0)
      buf_ = Tensor::empty({slots * static_cast<int64_t>(stride_ / 2)}, DType::bf16, MemCategory::workspace, tag);
  }
  void* of(int64_t slot) const {
    return stride_ > 0 ? static_cast<char*>(buf_.raw()) + static_cast<size_t>(slot) * stride_ : nullptr;
  }

 private:
  size_t stride_;
  Tensor buf_;
};

int64_t scratch_slots(int64_t tasks) { return omp_in_parallel() ? 1 : std::min<int64_t>(num_threads(), tasks); }

// ---- Forward ----

// T: the tensors' dtype; C: the packed operands' and products' (T, or f32 for
// bf16 tensors whose products run widened).
template <class T, class C>
void forward_impl(const Dims& d, const T* q, const T* k, const T* v, T* out, float* lse, const AttentionTiles& tiles) {
  const int64_t Tq = d.Tq, D = d.D, Lk = d.keys_seen();
  // With queries after the keys' start the causal diagonal moves right by
  // `shift` keys; a whole sequence has shift 0.
  const int64_t shift = d.q_first - d.k_first;
  // The causal grid sizes the buffers; a sequence of short documents may run
  // on the finer document grid (sequence_grids).
  const Grid grid = forward_grid(d, tiles);
  const int64_t Bq = grid.Bq, Bk = grid.Bk;
  const std::vector<Grid> grids = sequence_grids(d, grid, tiles, /*forward=*/true);
  const DType ab = dtype_of<C>();
  const int64_t n_qtiles = (Tq + Bq - 1) / Bq;
  // Under the causal mask query tile i costs ∝ shift + i + 1 key blocks, so
  // tiles go in pairs (i, n_qtiles − 1 − i) of equal total cost; splits take
  // pairs round-robin and stay balanced.
  const int64_t pairs = (n_qtiles + 1) / 2;
  const int64_t owners = d.B * d.Hkv, splits = task_splits(owners, pairs);
  const float scale2 = d.scale * kLog2e;  // scores in log2 units: S = scale·log2(e)·Q Kᵀ, P = 2^(S − m)
  // The keys query tile [q0, q0 + mq) sees: those before its last query.
  const auto tile_keys = [&](int64_t q0, int64_t mq) { return std::min(Lk, shift + q0 + mq); };

  // Scratch per thread, once per call: the packed keys and values of one kv
  // head, one packed query tile, one score block, its probabilities, the
  // output accumulator and the running max / sum per row.
  const int64_t slots = scratch_slots(owners * splits);
  Tensor kv_buf = Tensor::empty({slots, 2, Lk, D}, ab, MemCategory::workspace, "attention.fwd.kv_packed");
  Tensor q_buf = Tensor::empty({slots, Bq, D}, ab, MemCategory::workspace, "attention.fwd.q_packed");
  Tensor s_buf = Tensor::empty({slots, Bq * Bk}, DType::f32, MemCategory::workspace, "attention.fwd.scores");
  Tensor p_buf = Tensor::empty({slots, Bq * Bk}, ab, MemCategory::workspace, "attention.fwd.probs");
  Tensor o_buf = Tensor::empty({slots, Bq, D}, DType::f32, MemCategory::workspace, "attention.fwd.out_acc");
  Tensor ml_buf = Tensor::empty({slots, 2, Bq}, DType::f32, MemCategory::workspace, "attention.fwd.max_sum");
  // oneDNN's scratchpad for the tile products, one per slot: the most any
  // (query tile, key block) of the loop below needs.
  std::set<std::pair<int64_t, int64_t>> tile_shapes;
  // Blocks start on multiples of g.align and run up to g.Bk keys: every
  // block is g.Bk wide but those ending at kend, whose starts are the aligned
  // ones in the last g.Bk keys before it.
  for (const Grid& g : candidate_grids(d, grid, tiles, /*forward=*/true))
    for (int64_t q0 = 0; q0 < Tq; q0 += g.Bq) {
      const int64_t mq = std::min(g.Bq, Tq - q0), kend = tile_keys(q0, mq);
      if (kend >= g.Bk) tile_shapes.insert({mq, g.Bk});
      for (int64_t k0 = std::max<int64_t>(0, kend - g.Bk) / g.align * g.align; k0 < kend; k0 += g.align)
        tile_shapes.insert({mq, std::min(g.Bk, kend - k0)});
    }
  size_t tile_scratch = 0;
  for (const auto& [mq, nk] : tile_shapes)
    for (bool acc : {false, true})
      tile_scratch = std::max({tile_scratch,
                               gemm_scratchpad_bytes({.M = mq, .N = nk, .K = D, .trans_b = true, .ab = ab,
                                                      .c = DType::f32, .alpha = scale2}),
                               gemm_scratchpad_bytes({.M = mq, .N = D, .K = nk, .ab = ab, .c = DType::f32,
                                                      .accumulate = acc})});
  const TileScratch gemm_scratch(slots, tile_scratch, "attention.fwd.gemm_scratchpad");
  if (dry_run()) return;  // what the call allocates, and nothing more
  std::atomic<int64_t> next_task{0};
  parallel_for(0, slots, 1, [&](int64_t slot, int64_t slot_end) {
    ANVIL_ASSERT(slot_end == slot + 1, "one scratch slot per thread");
    C* Kp = kv_buf.data<C>() + slot * 2 * Lk * D;
    C* Vp = Kp + Lk * D;
    C* Qp = q_buf.data<C>() + slot * Bq * D;
    float* S = s_buf.data<float>() + slot * Bq * Bk;
    C* P = p_buf.data<C>() + slot * Bq * Bk;
    float* O = o_buf.data<float>() + slot * Bq * D;
    float* row_m = ml_buf.data<float>() + slot * 2 * Bq;
    float* row_l = row_m + Bq;
    void* const sp = gemm_scratch.of(slot);

    // Rows q0 .. q0 + mq of query head h. Blocks are packed densely (row
    // stride = their width nk) so every product sees dense operands.
    auto query_tile = [&](int64_t b, int64_t h, int64_t q0) {
      const Grid& gb = grids[static_cast<size_t>(b)];
      const int64_t mq = std::min(gb.Bq, Tq - q0);
      pack_head(q, d, Tq, d.Hq, b, h, q0, mq, Qp);
      // Key blocks before the one holding the first row's document start are
      // masked for every row (documents start no earlier on later rows).
      const auto [kbeg, kend] = forward_keys(d, gb, b, q0);
      std::fill(row_m, row_m + mq, -std::numeric_limits<float>::infinity());  // no key seen yet
      std::fill(row_l, row_l + mq, 0.0f);
      for (int64_t k0 = kbeg; k0 < kend; k0 += gb.Bk) {
        const int64_t nk = std::min(gb.Bk, kend - k0);  // keys past the tile's last query are masked for all rows
        const bool first = k0 == kbeg;
        gemm({.M = mq, .N = nk, .K = D, .trans_b = true, .ab = ab, .c = DType::f32, .alpha = scale2}, Qp, Kp + k0 * D,
             S, sp);
        for (int64_t r = 0; r < mq; ++r) {
          // The row's keys in the block: its document's, up to its position.
          const int64_t lo = std::clamp<int64_t>(d.first_key_of(b, q0 + r) - k0, 0, nk);
          const int64_t hi = std::min(nk, d.keys_of(q0 + r) - k0);
          float* srow = S + r * nk;
          C* prow = P + r * nk;
          if (hi <= lo) {  // the row sees none of the block's keys: P = 0
            exp_row(srow, 0.0f, 0, nk, prow);
            continue;
          }
          std::fill(prow, prow + lo, from_f32<C>(0.0f));
          const float m_blk = row_max(srow + lo, hi - lo);
          if (row_m[r] == -std::numeric_limits<float>::infinity()) {  // the row's first keys; its O row is 0
            row_m[r] = m_blk;
            row_l[r] = exp_row(srow + lo, m_blk, hi - lo, nk - lo, prow + lo);
          } else {
            const float m_new = std::max(row_m[r], m_blk);
            const float corr = std::exp2(row_m[r] - m_new);
            row_l[r] = row_l[r] * corr + exp_row(srow + lo, m_new, hi - lo, nk - lo, prow + lo);
            if (corr != 1.0f) scale_row(O + r * D, corr, D);
            row_m[r] = m_new;
          }
        }
        gemm({.M = mq, .N = D, .K = nk, .ab = ab, .c = DType::f32, .accumulate = !first}, P, Vp + k0 * D, O, sp);
      }
      for (int64_t r = 0; r < mq; ++r) {
        T* orow = out + ((b * Tq + q0 + r) * d.Hq + h) * D;
        float& row_lse = lse[(b * d.Hq + h) * Tq + q0 + r];
        if (row_l[r] == 0.0f) {  // no key of this window in the row's document
          std::fill(orow, orow + D, from_f32<T>(0.0f));
          row_lse = -std::numeric_limits<float>::infinity();
          continue;
        }
        store_scaled_row(O + r * D, 1.0f / row_l[r], D, orow);
        row_lse = (row_m[r] + std::log2(row_l[r])) * kLn2;  // back to natural log
      }
    };

    for (int64_t task; (task = next_task.fetch_add(1)) < owners * splits;) {
      const int64_t s = task % splits, bg = task / splits, b = bg / d.Hkv, g = bg % d.Hkv;
      pack_head(k, d, d.Tk, d.Hkv, b, g, 0, Lk, Kp);
      pack_head(v, d, d.Tk, d.Hkv, b, g, 0, Lk, Vp);
      const int64_t Bq_b = grids[static_cast<size_t>(b)].Bq, n_qtiles_b = (Tq + Bq_b - 1) / Bq_b;
      for (int64_t p = s; p < (n_qtiles_b + 1) / 2; p += splits) {
        const int64_t mirror = n_qtiles_b - 1 - p;
        for (int64_t h = g * d.group; h < (g + 1) * d.group; ++h) {
          query_tile(b, h, p * Bq_b);
          if (mirror != p) query_tile(b, h, mirror * Bq_b);
        }
      }
    }
  });
}

// ---- Backward ----
//
// Race freedom: a task owns (batch b, kv head g, split s) and walks its share
// of g's key tiles; for each key tile it visits every query head of the group
// and every query tile at or below the diagonal. dK_j and dV_j are summed in
// task-local f32 accumulators (no other task touches key tile j of kv head g),
// and dQ rows of the group's heads are summed in a task-local f32 buffer
// written to dq at the end — with one split no other task writes those rows,
// so no atomics and no partial copies of dK/dV, and each block costs just the
// 5 products the FLOP count assumes (a separate dQ pass would recompute P and
// dP: 7). With several splits (only when B·Hkv does not divide over the
// threads) the splits' dQ buffers are added into an f32 sum under a lock, once
// per task.
//
// Blocks are computed transposed, keys along rows (Sᵀ = K_j Q_iᵀ): then
// dV_j += Pᵀ dO_i and dK_j += dSᵀ Q_i are plain products and only dQ_i += dS
// K_j reads a transposed operand, which oneDNN runs ~1.5× slower.

template <class T, class C>
void backward_impl(const Dims& d, const T* dout, const T* q, const T* k, const T* v, const T* out, const float* lse,
                   T* dq, T* dk, T* dv, const AttentionTiles& tiles, AttentionAccumulate accumulate) {
  const int64_t Tq = d.Tq, D = d.D, G = d.group, Lk = d.keys_seen();
  const int64_t shift = d.q_first - d.k_first;  // see forward_impl
  const Grid grid = backward_grid(d, tiles);  // sizes the buffers, as in forward_impl
  const int64_t Bq = grid.Bq, Bk = grid.Bk;
  const std::vector<Grid> grids = sequence_grids(d, grid, tiles, /*forward=*/false);
  const DType ab = dtype_of<C>();
  const int64_t n_ktiles = (Lk + Bk - 1) / Bk;
  // Key tile j costs ∝ (T − k0): pair j with n_ktiles − 1 − j as the forward does.
  const int64_t pairs = (n_ktiles + 1) / 2;
  const int64_t owners = d.B * d.Hkv, splits = task_splits(owners, pairs);
  const float scale2 = d.scale * kLog2e;  // scores in log2 units, as in the forward
  // The first query row that sees key row k0: the queries before it see none.
  const auto first_query = [&](int64_t k0) { return std::max<int64_t>(0, k0 - shift); };

  // With several splits, each split's dQ partial goes to its own slot and the
  // slots are summed in split order afterwards: a fixed reduction order, so the
  // result is bitwise the same on every run (a lock-ordered sum would not be).
  Tensor dq_parts_buf;  // (splits, B, Tq, Hq, D) f32, only with several splits
  if (splits > 1)
    dq_parts_buf =
        Tensor::empty({splits, d.B, Tq, d.Hq, D}, DType::f32, MemCategory::workspace, "attention.bwd.dq_parts");

  // Scratch per thread, once per call (see scratch_slots): packed K, V of one
  // kv head and Q, dO, dQ (f32), Δ, lse of its G query heads; one transposed
  // block of scores/dP (f32) and P/dS (storage dtype); the dK_j, dV_j accumulators.
  const int64_t slots = scratch_slots(owners * splits);
  Tensor kv_buf = Tensor::empty({slots, 2, Lk, D}, ab, MemCategory::workspace, "attention.bwd.kv_packed");
  Tensor q_buf = Tensor::empty({slots, 2, G, Tq, D}, ab, MemCategory::workspace, "attention.bwd.q_dout_packed");
  Tensor dq_buf = Tensor::empty({slots, G, Tq, D}, DType::f32, MemCategory::workspace, "attention.bwd.dq_acc");
  Tensor stats_buf = Tensor::empty({slots, 2, G, Tq}, DType::f32, MemCategory::workspace, "attention.bwd.delta_lse2");
  Tensor s_buf = Tensor::empty({slots, 2, Bk * Bq}, DType::f32, MemCategory::workspace, "attention.bwd.scores_dprobs");
  Tensor p_buf = Tensor::empty({slots, 2, Bk * Bq}, ab, MemCategory::workspace, "attention.bwd.probs_dscores");
  Tensor acc_buf = Tensor::empty({slots, 2, Bk, D}, DType::f32, MemCategory::workspace, "attention.bwd.dk_dv_acc");
  // oneDNN's scratchpad for the tile products, one per slot: the most any
  // (key tile, query tile) of the loop below needs.
  std::set<std::pair<int64_t, int64_t>> tile_shapes;  // (keys ne, queries mq)
  // A query tile's rows: g.Bq, the rest of the sequence, or (cut at a
  // document's end) a multiple of g.align below both.
  for (const Grid& g : candidate_grids(d, grid, tiles, /*forward=*/false))
    for (int64_t k0 = 0; k0 < Lk; k0 += g.Bk)
      for (int64_t q0 = first_query(k0), nk = std::min(g.Bk, Lk - k0); q0 < Tq; q0 += g.Bq) {
        const int64_t full = std::min(g.Bq, Tq - q0);
        for (int64_t mq = g.align < full ? g.align : full;; mq = std::min(full, mq + g.align)) {
          tile_shapes.insert({std::min(nk, shift + q0 + mq - k0), mq});
          if (mq == full) break;
        }
      }
  size_t tile_scratch = 0;
  for (const auto& [ne, mq] : tile_shapes)
    for (bool acc : {false, true})
      tile_scratch = std::max(
          {tile_scratch,
           gemm_scratchpad_bytes({.M = ne, .N = mq, .K = D, .trans_b = true, .ab = ab, .c = DType::f32, .alpha = scale2}),
           gemm_scratchpad_bytes({.M = ne, .N = mq, .K = D, .trans_b = true, .ab = ab, .c = DType::f32}),
           gemm_scratchpad_bytes({.M = ne, .N = D, .K = mq, .ab = ab, .c = DType::f32, .accumulate = true}),
           gemm_scratchpad_bytes(
               {.M = mq, .N = D, .K = ne, .trans_a = true, .ab = ab, .c = DType::f32, .accumulate = acc})});
  const TileScratch gemm_scratch(slots, tile_scratch, "attention.bwd.gemm_scratchpad");
  if (dry_run()) return;  // what the call allocates, and nothing more
  std::atomic<int64_t> next_task{0};
  parallel_for(0, slots, 1, [&](int64_t slot, int64_t slot_end) {
    ANVIL_ASSERT(slot_end == slot + 1, "one scratch slot per thread");
    C* Kp = kv_buf.data<C>() + slot * 2 * Lk * D;
    C* Vp = Kp + Lk * D;
    C* Qp = q_buf.data<C>() + slot * 2 * G * Tq * D;  // (G, Tq, D)
    C* dOp = Qp + G * Tq * D;                         // (G, Tq, D)
    float* dQp = dq_buf.data<float>() + slot * G * Tq * D;
    float* delta = stats_buf.data<float>() + slot * 2 * G * Tq;  // (G, Tq) Δ per query row
    float* lse2 = delta + G * Tq;                                // (G, Tq) lse in log2 units
    float* St = s_buf.data<float>() + slot * 2 * Bk * Bq;
    float* dPt = St + Bk * Bq;
    C* Pt = p_buf.data<C>() + slot * 2 * Bk * Bq;
    C* dSt = Pt + Bk * Bq;
    float* dK_acc = acc_buf.data<float>() + slot * 2 * Bk * D;
    float* dV_acc = dK_acc + Bk * D;
    void* const sp = gemm_scratch.of(slot);

    // Key tile j (keys k0 .. k0 + nk) of kv head g, against all later queries.
    auto key_tile = [&](int64_t b, int64_t g, int64_t j) {
      const Grid& gb = grids[static_cast<size_t>(b)];
      const int64_t k0 = j * gb.Bk, nk = std::min(gb.Bk, Lk - k0);
      const C* Kj = Kp + k0 * D;
      const C* Vj = Vp + k0 * D;
      // Causal: key tile 0 is seen by every query row (q_first ≥ k_first), so
      // its dQ products write instead of adding and dQp needs no zeroing in the
      // task that owns it. Under documents dQp starts zeroed instead.
      const bool dq_first = j == 0 && d.docs == nullptr;
      // Earlier queries, and those from the end of the last key's document on, see none of its keys.
      const auto [qbeg, qend] = backward_queries(d, gb, b, k0);
      std::fill(dK_acc, dK_acc + 2 * Bk * D, 0.0f);
      for (int64_t hh = 0; hh < G; ++hh) {
        for (int64_t q0 = qbeg; q0 < qend; q0 += gb.Bq) {
          const int64_t mq = backward_rows(gb, Tq, q0, qend);
          const int64_t ne = std::min(nk, shift + q0 + mq - k0);  // keys after the tile's last query are masked
          const C* Qi = Qp + (hh * Tq + q0) * D;
          const C* dOi = dOp + (hh * Tq + q0) * D;
          gemm({.M = ne, .N = mq, .K = D, .trans_b = true, .ab = ab, .c = DType::f32, .alpha = scale2}, Kj, Qi, St,
               sp);
          gemm({.M = ne, .N = mq, .K = D, .trans_b = true, .ab = ab, .c = DType::f32}, Vj, dOi, dPt, sp);
          for (int64_t r = 0; r < ne; ++r)  // key k0 + r is seen by queries q0 + i with i ≥ k0 + r − shift − q0
            grad_row(St + r * mq, dPt + r * mq, lse2 + hh * Tq + q0, delta + hh * Tq + q0, d.scale,
                     std::max<int64_t>(0, k0 + r - shift - q0), d.query_end_of(b, k0 + r) - q0, mq, Pt + r * mq,
                     dSt + r * mq);
          gemm({.M = ne, .N = D, .K = mq, .ab = ab, .c = DType::f32, .accumulate = true}, Pt, dOi, dV_acc, sp);
          gemm({.M = ne, .N = D, .K = mq, .ab = ab, .c = DType::f32, .accumulate = true}, dSt, Qi, dK_acc, sp);
          gemm({.M = mq, .N = D, .K = ne, .trans_a = true, .ab = ab, .c = DType::f32, .accumulate = !dq_first}, dSt, Kj,
               dQp + (hh * Tq + q0) * D, sp);
        }
      }
      unpack_head(dK_acc, d, d.Tk, d.Hkv, b, g, k0, nk, dk, accumulate.dkv);
      unpack_head(dV_acc, d, d.Tk, d.Hkv, b, g, k0, nk, dv, accumulate.dkv);
    };

    for (int64_t task; (task = next_task.fetch_add(1)) < owners * splits;) {
      const int64_t s = task % splits, bg = task / splits, b = bg / d.Hkv, g = bg % d.Hkv;
      pack_head(k, d, d.Tk, d.Hkv, b, g, 0, Lk, Kp);
      pack_head(v, d, d.Tk, d.Hkv, b, g, 0, Lk, Vp);
      for (int64_t hh = 0; hh < G; ++hh) {
        const int64_t h = g * G + hh;
        pack_head(q, d, Tq, d.Hq, b, h, 0, Tq, Qp + hh * Tq * D);
        pack_head(dout, d, Tq, d.Hq, b, h, 0, Tq, dOp + hh * Tq * D);
        for (int64_t t = 0; t < Tq; ++t) {  // Δ = rowsum(dout ∘ out), the softmax-backward correction
          const int64_t row = ((b * Tq + t) * d.Hq + h) * D;
          delta[hh * Tq + t] = dot_row(dout + row, out + row, D);
          lse2[hh * Tq + t] = lse[(b * d.Hq + h) * Tq + t] * kLog2e;
        }
      }
      // Keys no query sees get no gradient: zero, unless adding to what is there.
      if (!accumulate.dkv && Lk < d.Tk && s == 0) {
        for (int64_t t = Lk; t < d.Tk; ++t) {
          std::fill(dk + ((b * d.Tk + t) * d.Hkv + g) * D, dk + ((b * d.Tk + t) * d.Hkv + g) * D + D, from_f32<T>(0));
          std::fill(dv + ((b * d.Tk + t) * d.Hkv + g) * D, dv + ((b * d.Tk + t) * d.Hkv + g) * D + D, from_f32<T>(0));
        }
      }
      // Causal: split 0 owns key tile 0 and starts with it (see key_tile).
      if (s != 0 || d.docs) std::fill(dQp, dQp + G * Tq * D, 0.0f);
      const int64_t Bk_b = grids[static_cast<size_t>(b)].Bk, n_ktiles_b = (Lk + Bk_b - 1) / Bk_b;
      for (int64_t p = s; p < (n_ktiles_b + 1) / 2; p += splits) {
        key_tile(b, g, p);
        if (n_ktiles_b - 1 - p != p) key_tile(b, g, n_ktiles_b - 1 - p);
      }
      if (splits == 1) {
        for (int64_t hh = 0; hh < G; ++hh)
          unpack_head(dQp + hh * Tq * D, d, Tq, d.Hq, b, g * G + hh, 0, Tq, dq, accumulate.dq);
      } else {  // this task alone writes these rows of slot s
        float* part = dq_parts_buf.data<float>() + s * d.B * Tq * d.Hq * D;
        for (int64_t hh = 0; hh < G; ++hh)
          for (int64_t t = 0; t < Tq; ++t) {
            float* dst = part + ((b * Tq + t) * d.Hq + g * G + hh) * D;
            const float* src = dQp + (hh * Tq + t) * D;
            std::copy(src, src + D, dst);
          }
      }
    }
  });

  if (splits > 1) {
    const float* parts = dq_parts_buf.data<float>();
    const int64_t slot = d.B * Tq * d.Hq * D;
    parallel_for(0, d.B * Tq * d.Hq, 64, [&](int64_t lo, int64_t hi) {
      std::vector<float> sum(static_cast<size_t>(D));
      for (int64_t row = lo; row < hi; ++row) {
        std::copy(parts + row * D, parts + row * D + D, sum.begin());
        for (int64_t sp = 1; sp < splits; ++sp)
          for (int64_t e = 0; e < D; ++e) sum[static_cast<size_t>(e)] += parts[sp * slot + row * D + e];
        if (accumulate.dq)
          for (int64_t e = 0; e < D; ++e)
            dq[row * D + e] = from_f32<T>(to_f32(dq[row * D + e]) + sum[static_cast<size_t>(e)]);
        else
          store_scaled_row(sum.data(), 1.0f, D, dq + row * D);
      }
    });
  }
}

}  // namespace

bool attention_products_widened(DType dtype) { return dtype == DType::bf16 && bf16_products_widened(); }

AttentionTileCount attention_tile_count(int64_t B, int64_t Tq, int64_t Tk, const AttentionTiles& tiles,
                                        const AttentionWindow& window) {
  AttentionTileCount n;
  for (const bool masked : {true, false}) {
    Dims d{B, Tq, Tk, 1, 1, 1, 1, 1.0f, window.q_first, window.k_first};
    if (masked && window.documents.defined()) {
      d.docs = window.documents.data<int32_t>();
      d.S = window.documents.size(2);
    }
    const int64_t shift = d.q_first - d.k_first, Lk = d.keys_seen();
    const std::vector<Grid> fwd = sequence_grids(d, forward_grid(d, tiles), tiles, /*forward=*/true),
                            bwd = sequence_grids(d, backward_grid(d, tiles), tiles, /*forward=*/false);
    double& f = masked ? n.forward : n.causal_forward;
    double& g = masked ? n.backward : n.causal_backward;
    for (int64_t b = 0; b < B; ++b) {  // the products' shapes, as the kernels' loops run them
      const Grid& fb = fwd[static_cast<size_t>(b)];
      const Grid& bb = bwd[static_cast<size_t>(b)];
      for (int64_t q0 = 0; q0 < Tq; q0 += fb.Bq) {
        const auto [kbeg, kend] = forward_keys(d, fb, b, q0);
        for (int64_t k0 = kbeg; k0 < kend; k0 += fb.Bk)
          f += static_cast<double>(std::min(fb.Bq, Tq - q0) * std::min(fb.Bk, kend - k0));
      }
      for (int64_t k0 = 0; k0 < Lk; k0 += bb.Bk) {
        const auto [qbeg, qend] = backward_queries(d, bb, b, k0);
        const int64_t nk = std::min(bb.Bk, Lk - k0);
        for (int64_t q0 = qbeg; q0 < qend; q0 += bb.Bq) {
          const int64_t mq = backward_rows(bb, Tq, q0, qend);
          g += static_cast<double>(std::min(nk, shift + q0 + mq - k0) * mq);
        }
      }
    }
  }
  return n;
}

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse, float scale,
                       const AttentionTiles& tiles, const AttentionWindow& window) {
  if (on_gpu("attention.forward", q, k, v, out, lse)) {
    const ScopedOpTime op("attention.forward");
    check_gpu_operands(q, k, v, out, lse);
    return attention_forward_gpu(q, k, v, out, lse, scale, window);
  }
  const Dims d = attention_dims(q, k, v, scale, window);
  const ScopedOpTime op("attention.forward", attention_flops(d, 4));
  check_like(out, q, "out");
  check_lse(lse, d);
  ANVIL_ASSERT(tiles.fwd_q > 0 && tiles.fwd_k > 0, "attention: tile sizes must be positive");
  if (q.numel() == 0) return;
  if (q.dtype() == DType::f32)
    forward_impl<float, float>(d, q.data<float>(), k.data<float>(), v.data<float>(), out.data<float>(),
                               lse.data<float>(), tiles);
  else if (attention_products_widened(q.dtype()))
    forward_impl<bf16, float>(d, q.data<bf16>(), k.data<bf16>(), v.data<bf16>(), out.data<bf16>(), lse.data<float>(),
                              tiles);
  else
    forward_impl<bf16, bf16>(d, q.data<bf16>(), k.data<bf16>(), v.data<bf16>(), out.data<bf16>(), lse.data<float>(),
                             tiles);
}

void attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                        const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv, float scale, const AttentionTiles& tiles,
                        const AttentionWindow& window, AttentionAccumulate accumulate) {
  if (on_gpu("attention.backward", q, k, v, dout, out, lse, dq, dk, dv)) {
    const ScopedOpTime op("attention.backward");
    check_gpu_operands(q, k, v, out, lse);
    check_like(dout, q, "dout");
    check_like(dq, q, "dq");
    check_like(dk, k, "dk");
    check_like(dv, v, "dv");
    return attention_backward_gpu(dout, q, k, v, out, lse, dq, dk, dv, scale, window, accumulate);
  }
  const Dims d = attention_dims(q, k, v, scale, window);
  const ScopedOpTime op("attention.backward", attention_flops(d, 8));
  check_like(dout, q, "dout");
  check_like(out, q, "out");
  check_like(dq, q, "dq");
  check_like(dk, k, "dk");
  check_like(dv, v, "dv");
  check_lse(lse, d);
  ANVIL_ASSERT(tiles.bwd_q > 0 && tiles.bwd_k > 0, "attention: tile sizes must be positive");
  if (q.numel() == 0) return;
  if (q.dtype() == DType::f32)
    backward_impl<float, float>(d, dout.data<float>(), q.data<float>(), k.data<float>(), v.data<float>(),
                                out.data<float>(), lse.data<float>(), dq.data<float>(), dk.data<float>(),
                                dv.data<float>(), tiles, accumulate);
  else if (attention_products_widened(q.dtype()))
    backward_impl<bf16, float>(d, dout.data<bf16>(), q.data<bf16>(), k.data<bf16>(), v.data<bf16>(), out.data<bf16>(),
                               lse.data<float>(), dq.data<bf16>(), dk.data<bf16>(), dv.data<bf16>(), tiles, accumulate);
  else
    backward_impl<bf16, bf16>(d, dout.data<bf16>(), q.data<bf16>(), k.data<bf16>(), v.data<bf16>(), out.data<bf16>(),
                              lse.data<float>(), dq.data<bf16>(), dk.data<bf16>(), dv.data<bf16>(), tiles, accumulate);
}

namespace {

template <class T>
void merge_impl(const T* part, const float* lse_part, float* acc, float* lse_acc, int64_t B, int64_t T_, int64_t H,
                int64_t D) {
  parallel_for(0, B * T_, 16, [&](int64_t lo, int64_t hi) {
    for (int64_t row = lo; row < hi; ++row) {
      const int64_t b = row / T_, t = row % T_;
      for (int64_t h = 0; h < H; ++h) {
        float& l = lse_acc[(b * H + h) * T_ + t];
        const float lp = lse_part[(b * H + h) * T_ + t];
        float* a = acc + (row * H + h) * D;
        const T* p = part + (row * H + h) * D;
        if (lp == -std::numeric_limits<float>::infinity()) continue;
        if (l == -std::numeric_limits<float>::infinity()) {
          for (int64_t i = 0; i < D; ++i) a[i] = to_f32(p[i]);
          l = lp;
          continue;
        }
        // Weights relative to the larger lse, so neither exponential overflows.
        const float m = std::max(l, lp), wa = std::exp(l - m), wp = std::exp(lp - m), sum = wa + wp;
        const float ca = wa / sum, cp = wp / sum;
        for (int64_t i = 0; i < D; ++i) a[i] = ca * a[i] + cp * to_f32(p[i]);
        l = m + std::log(sum);
      }
    }
  });
}

}  // namespace

void attention_merge(const Tensor& part, const Tensor& lse_part, Tensor& acc, Tensor& lse_acc) {
  ANVIL_ASSERT(acc.ndim() == 4 && acc.dtype() == DType::f32, "attention_merge: acc must be (B, T, H, D) f32, not ",
               dtype_name(acc.dtype()), " ", shape_str(acc.shape()));
  ANVIL_ASSERT(part.shape() == acc.shape() && part.dtype() != DType::i32, "attention_merge: part ",
               shape_str(part.shape()), " ", dtype_name(part.dtype()), " against acc ", shape_str(acc.shape()));
  const int64_t B = acc.size(0), T = acc.size(1), H = acc.size(2), D = acc.size(3);
  const Shape lse_shape = {B, H, T};
  ANVIL_ASSERT(lse_part.shape() == lse_shape && lse_acc.shape() == lse_shape && lse_part.dtype() == DType::f32 &&
                   lse_acc.dtype() == DType::f32,
               "attention_merge: lse must be (B, H, T) f32 = ", shape_str(lse_shape));
  const ScopedOpTime op("attention.merge");
  if (part.dtype() == DType::f32)
    merge_impl(part.data<float>(), lse_part.data<float>(), acc.data<float>(), lse_acc.data<float>(), B, T, H, D);
  else
    merge_impl(part.data<bf16>(), lse_part.data<float>(), acc.data<float>(), lse_acc.data<float>(), B, T, H, D);
}

}  // namespace anvil
