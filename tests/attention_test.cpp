// Causal and block-causal (documents) grouped-query attention against a naive
// double-precision reference (full softmax per query row, no tiling), plus
// finite differences of that reference for the backward. Small tile sizes are passed on small T so every
// multi-tile path (online-softmax rescaling, partial tiles, blocks above the
// diagonal, several query tiles per key tile) runs in a fraction of a second.
#include "anvil/ops/attention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <limits>
#include <string>

#include "anvil/core/parallel_for.h"
#include "anvil/ops/document_mask.h"
#include "anvil/ops/matmul.h"
#include "test_util.h"

namespace {

using namespace anvil;
using namespace anvil::testing;

struct Case {
  int64_t B, T, Hq, Hkv, D;
  AttentionTiles tiles;
  float scale = 0.0f;  // 0: 1/sqrt(D)
  // Documents: sequence b holds documents of lengths docs[b % n], docs[(b + 1) % n], …
  // (the last cut at T); empty: causal, no documents tensor.
  std::vector<int64_t> docs = {};
};

std::string describe(const Case& c) {
  char buf[200];
  std::snprintf(buf, sizeof buf, "B=%ld T=%ld Hq=%ld Hkv=%ld D=%ld tiles fwd %ldx%ld bwd %ldx%ld", long(c.B), long(c.T),
                long(c.Hq), long(c.Hkv), long(c.D), long(c.tiles.fwd_q), long(c.tiles.fwd_k), long(c.tiles.bwd_q),
                long(c.tiles.bwd_k));
  std::string out = buf;
  if (!c.docs.empty()) {
    out += " docs";
    for (int64_t n : c.docs) {
      out += ' ';
      out += std::to_string(n);
    }
  }
  return out;
}

// The first position of position t's document in sequence b (0 without documents).
int64_t doc_start(const Case& c, int64_t b, int64_t t) {
  if (c.docs.empty()) return 0;
  const size_t n = c.docs.size();
  for (int64_t s = 0, i = 0;; s += c.docs[(size_t(b) + size_t(i)) % n], ++i)
    if (t < s + c.docs[(size_t(b) + size_t(i)) % n]) return s;
}

// The case's documents as the loader finds them: tokens with an EOS (id 1)
// closing each document, turned into bounds by fill_document_bounds. Undefined
// without documents.
Tensor documents_of(const Case& c) {
  if (c.docs.empty()) return Tensor();
  Tensor tokens = Tensor::zeros({c.B, c.T}, DType::i32, MemCategory::workspace, "tokens");
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t t = 0; t + 1 < c.T; ++t)
      if (doc_start(c, b, t + 1) == t + 1) tokens.data<int32_t>()[b * c.T + t] = 1;
  Tensor bounds = Tensor::empty({c.B, 2, c.T}, DType::i32, MemCategory::workspace, "documents");
  fill_document_bounds(tokens, 1, bounds);
  return bounds;
}

double scale_of(const Case& c) { return c.scale != 0.0f ? c.scale : 1.0 / std::sqrt(double(c.D)); }

// Index of (b, t, h, e) in a (B, T, H, D) tensor.
inline size_t at(const Case& c, int64_t H, int64_t b, int64_t t, int64_t h, int64_t e) {
  return size_t(((b * c.T + t) * H + h) * c.D + e);
}

// Softmax probabilities of query (b, t, h) over keys 0..t, in double; those
// before its document's start are 0.
std::vector<double> ref_probs(const Case& c, const std::vector<double>& q, const std::vector<double>& k, int64_t b,
                              int64_t t, int64_t h, double* lse) {
  const int64_t g = h / (c.Hq / c.Hkv);
  std::vector<double> p(size_t(t + 1), -std::numeric_limits<double>::infinity());
  double m = -1e300;
  for (int64_t j = doc_start(c, b, t); j <= t; ++j) {
    double s = 0;
    for (int64_t e = 0; e < c.D; ++e) s += q[at(c, c.Hq, b, t, h, e)] * k[at(c, c.Hkv, b, j, g, e)];
    p[size_t(j)] = s * scale_of(c);
    m = std::max(m, p[size_t(j)]);
  }
  double l = 0;
  for (double& x : p) l += (x = std::exp(x - m));
  for (double& x : p) x /= l;
  if (lse) *lse = m + std::log(l);
  return p;
}

struct RefForward {
  std::vector<double> out, lse;
};

RefForward ref_forward(const Case& c, const std::vector<double>& q, const std::vector<double>& k,
                       const std::vector<double>& v) {
  RefForward r{std::vector<double>(q.size(), 0.0), std::vector<double>(size_t(c.B * c.Hq * c.T))};
  const int64_t group = c.Hq / c.Hkv;
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.Hq; ++h)
      for (int64_t t = 0; t < c.T; ++t) {
        const std::vector<double> p = ref_probs(c, q, k, b, t, h, &r.lse[size_t((b * c.Hq + h) * c.T + t)]);
        for (int64_t j = 0; j <= t; ++j)
          for (int64_t e = 0; e < c.D; ++e)
            r.out[at(c, c.Hq, b, t, h, e)] += p[size_t(j)] * v[at(c, c.Hkv, b, j, h / group, e)];
      }
  return r;
}

struct RefGrads {
  std::vector<double> dq, dk, dv;
};

// The textbook softmax backward per query row: dP = dout·v_j,
// dS = P (dP − Σ_j P dP), then dq = scale Σ_j dS k_j, dk_j += scale dS q, dv_j += P dout.
RefGrads ref_backward(const Case& c, const std::vector<double>& q, const std::vector<double>& k,
                      const std::vector<double>& v, const std::vector<double>& dout) {
  RefGrads g{std::vector<double>(q.size(), 0.0), std::vector<double>(k.size(), 0.0),
             std::vector<double>(v.size(), 0.0)};
  const int64_t group = c.Hq / c.Hkv;
  const double scale = scale_of(c);
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < c.Hq; ++h)
      for (int64_t t = 0; t < c.T; ++t) {
        const int64_t kh = h / group;
        const std::vector<double> p = ref_probs(c, q, k, b, t, h, nullptr);
        std::vector<double> dp(p.size(), 0.0);
        double pdp = 0;
        for (int64_t j = 0; j <= t; ++j) {
          for (int64_t e = 0; e < c.D; ++e)
            dp[size_t(j)] += dout[at(c, c.Hq, b, t, h, e)] * v[at(c, c.Hkv, b, j, kh, e)];
          pdp += p[size_t(j)] * dp[size_t(j)];
        }
        for (int64_t j = 0; j <= t; ++j) {
          const double ds = p[size_t(j)] * (dp[size_t(j)] - pdp) * scale;
          for (int64_t e = 0; e < c.D; ++e) {
            g.dq[at(c, c.Hq, b, t, h, e)] += ds * k[at(c, c.Hkv, b, j, kh, e)];
            g.dk[at(c, c.Hkv, b, j, kh, e)] += ds * q[at(c, c.Hq, b, t, h, e)];
            g.dv[at(c, c.Hkv, b, j, kh, e)] += p[size_t(j)] * dout[at(c, c.Hq, b, t, h, e)];
          }
        }
      }
  return g;
}

struct OpRun {
  Tensor q, k, v, out, lse, dout, dq, dk, dv;
};

// Random inputs (q and k at ±2 so the softmax is far from uniform), then the
// op's forward and backward. Gradient outputs start as garbage: they must be
// overwritten, not accumulated into.
OpRun run_op(const Case& c, DType dt) {
  OpRun r;
  r.q = random_tensor({c.B, c.T, c.Hq, c.D}, dt, "q", 2.0f);
  r.k = random_tensor({c.B, c.T, c.Hkv, c.D}, dt, "k", 2.0f);
  r.v = random_tensor({c.B, c.T, c.Hkv, c.D}, dt, "v");
  r.dout = random_tensor({c.B, c.T, c.Hq, c.D}, dt, "dout");
  r.out = random_tensor(r.q.shape(), dt, "garbage_out", 100.0f);
  r.lse = random_tensor({c.B, c.Hq, c.T}, DType::f32, "garbage_lse", 100.0f);
  const AttentionWindow window{0, 0, documents_of(c)};
  attention_forward(r.q, r.k, r.v, r.out, r.lse, c.scale, c.tiles, window);
  r.dq = random_tensor(r.q.shape(), dt, "garbage_dq", 100.0f);
  r.dk = random_tensor(r.k.shape(), dt, "garbage_dk", 100.0f);
  r.dv = random_tensor(r.v.shape(), dt, "garbage_dv", 100.0f);
  attention_backward(r.dout, r.q, r.k, r.v, r.out, r.lse, r.dq, r.dk, r.dv, c.scale, c.tiles, window);
  return r;
}

// Relative error in norm; where the true answer is exactly zero (dq and dk at
// T = 1, where the softmax over one key is constant) the absolute error.
double grad_error(const Tensor& got, const std::vector<double>& want) {
  double norm = 0;
  for (double x : want) norm += x * x;
  return norm > 0 ? rel_error(got, want) : max_abs_error(to_double(got), want);
}

struct Errors {
  double out, lse, dq, dk, dv;
};

Errors compare_with_reference(const Case& c, DType dt) {
  const OpRun r = run_op(c, dt);
  // The reference sees exactly the values the op saw (bf16 inputs are exact in double).
  const std::vector<double> q = to_double(r.q), k = to_double(r.k), v = to_double(r.v), dout = to_double(r.dout);
  const RefForward f = ref_forward(c, q, k, v);
  const RefGrads g = ref_backward(c, q, k, v, dout);
  Errors e{rel_error(r.out, f.out), max_abs_error(to_double(r.lse), f.lse), grad_error(r.dq, g.dq),
           grad_error(r.dk, g.dk), grad_error(r.dv, g.dv)};
  std::printf("%-4s %-62s out %.2e  lse(abs) %.2e  dq %.2e  dk %.2e  dv %.2e\n", dtype_name(dt), describe(c).c_str(),
              e.out, e.lse, e.dq, e.dk, e.dv);
  return e;
}

const AttentionTiles kDefault{};
const AttentionTiles kSmall{8, 16, 8, 16};   // forward key tile wider than the query tile
const AttentionTiles kSmallQ{16, 8, 16, 8};  // the other way round: blocks above the diagonal per row
const AttentionTiles kOdd{7, 5, 5, 7};       // nothing divides anything
// Sequences of short documents (two or more, at most 4·doc on average) on a
// document grid of 4 × 4 tiles, the others on the 8 × 16 one.
const AttentionTiles kDocSmall{8, 16, 8, 16, 4};
const AttentionTiles kDocOdd{7, 5, 5, 7, 3};

// Shapes covering head_dim 8/16/64/128, GQA ratios 1, 2, 4, B = 2, T = 1,
// T not a multiple of any tile, and the default (large) tiles on T > tile.
std::vector<Case> cases() {
  return {
      {2, 37, 4, 2, 64, kSmall},      // GQA 2, B = 2
      {1, 50, 8, 2, 128, kSmallQ},    // GQA 4, D = 128
      {2, 29, 3, 3, 16, kOdd, 0.3f},  // GQA 1, explicit scale
      {1, 23, 4, 1, 8, kOdd},         // multi-query: B·Hkv = 1 < threads, split dQ partials
      {2, 1, 4, 2, 64, kDefault},     // T = 1
      {1, 1, 2, 2, 16, kSmall},       // T = 1, small tiles
      {1, 300, 4, 4, 64, kDefault},   // default tiles (capped at T/4 on the diagonal: 75)
      {2, 270, 4, 1, 128, kDefault},  // default tiles, GQA 4, D = 128
      {1, 700, 2, 1, 64, kDefault},   // default tiles, several full 256/512 blocks and partial ones
      // Documents shorter than, equal to and longer than the sequence; one of a single token.
      {2, 37, 4, 2, 64, kSmall, 0.0f, {5, 11, 1, 20}},
      {1, 50, 8, 2, 128, kSmallQ, 0.0f, {50}},
      {2, 29, 3, 3, 16, kOdd, 0.3f, {40}},
      {1, 23, 4, 1, 8, kOdd, 0.0f, {3, 7}},  // split dQ partials
      {1, 300, 4, 4, 64, kDefault, 0.0f, {37, 90, 3}},
      {2, 700, 2, 1, 64, kDefault, 0.0f, {256, 100, 300}},  // whole tiles skipped, others cut through
      // The document grid: both sequences on it; then sequence 0 (documents 40, 3, 7: 16.7 on
      // average, over 4·4) on the causal grid and sequence 1 (3, 40, 3, 4) on the document grid.
      {2, 37, 4, 2, 64, kDocSmall, 0.0f, {5, 11, 1, 20}},
      {2, 50, 4, 2, 16, kDocSmall, 0.0f, {40, 3}},
      {1, 23, 4, 1, 8, kDocOdd, 0.0f, {3, 7}},  // split dQ partials
      {1, 600, 4, 2, 64, kDefault, 0.0f, {90, 200, 37}},  // the default document grid, 128 × 128
  };
}

// f32: everything the op does is f32 arithmetic (f32 accumulation in the
// products, a 2^x accurate to ~1 ulp), so errors are f32 rounding level:
// measured 1e-7 to 6e-7 relative in norm for out/dq/dk/dv and up to 2e-6
// absolute for lse (values of a few units), growing slowly with T and D.
// The bound 1e-5 leaves a factor of 5–20 and still catches any real bug.
TEST(Attention, F32MatchesDoubleReference) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(describe(c));
    const Errors e = compare_with_reference(c, DType::f32);
    EXPECT_LT(e.out, 1e-5);
    EXPECT_LT(e.lse, 1e-5);  // absolute, on values of size ~log T
    EXPECT_LT(e.dq, 1e-5);
    EXPECT_LT(e.dk, 1e-5);
    EXPECT_LT(e.dv, 1e-5);
  }
}

// bf16: inputs are bf16 (the reference sees the same values); scores, softmax
// and all accumulation are f32, so lse stays f32-accurate (measured < 1.2e-6
// absolute; bound 1e-4). The losses are roundings to bf16, relative 2^-9 ≈
// 0.002 per value, ≈ 0.001 in norm for independent roundings: the stored out
// (measured 1.6e-3 to 1.9e-3 → bound 5e-3); in the backward additionally P and
// dS before their products and Δ from the rounded out, then the stored
// dq/dk/dv. Products average the roundings over many terms, so errors stay a
// small multiple of 2^-9: measured 2e-3 to 4e-3 (largest at D = 8, where dS =
// P (dP − Δ) cancels most) → bound 1e-2.
// Both routes of the products, whichever this CPU picks: native bf16 tiles, and
// operands widened to f32 (no rounding of P and dS, so the bounds hold a fortiori).
TEST(Attention, Bf16MatchesDoubleReference) {
  const bool chosen = bf16_products_widened();
  for (const bool widened : {false, true}) {
    set_bf16_products_widened(widened);
    ASSERT_EQ(attention_products_widened(DType::bf16), widened);
    for (const Case& c : cases()) {
      SCOPED_TRACE(::testing::Message() << (widened ? "widened " : "native ") << describe(c));
      const Errors e = compare_with_reference(c, DType::bf16);
      EXPECT_LT(e.out, 5e-3);
      EXPECT_LT(e.lse, 1e-4);
      EXPECT_LT(e.dq, 1e-2);
      EXPECT_LT(e.dk, 1e-2);
      EXPECT_LT(e.dv, 1e-2);
    }
  }
  set_bf16_products_widened(chosen);
}

// More threads than B·Hkv: the backward splits each kv head's key tiles over
// several tasks with separate dQ partial sums; check that path explicitly
// whatever OMP_NUM_THREADS is.
TEST(Attention, BackwardWithMoreThreadsThanKvHeads) {
  const int saved = num_threads();
  set_num_threads(4);
  for (const Case& c : {Case{1, 45, 4, 2, 16, kSmall}, Case{1, 33, 2, 1, 64, kOdd}}) {
    SCOPED_TRACE(describe(c));
    const Errors f = compare_with_reference(c, DType::f32);
    EXPECT_LT(f.dq, 1e-5);
    EXPECT_LT(f.dk, 1e-5);
    EXPECT_LT(f.dv, 1e-5);
    const Errors b = compare_with_reference(c, DType::bf16);
    EXPECT_LT(b.dq, 1e-2);
    EXPECT_LT(b.dk, 1e-2);
    EXPECT_LT(b.dv, 1e-2);
  }
  set_num_threads(saved);
}

// Central differences of the double reference forward (loss = Σ out·w) against
// the op's f32 backward with dout = w. The difference quotient is accurate to
// ~1e-9; the f32 backward to ~1e-6 relative.
TEST(Attention, BackwardMatchesFiniteDifferences) {
  for (const Case& c : {Case{2, 6, 4, 2, 8, {2, 3, 2, 3}}, Case{1, 5, 2, 1, 16, {4, 2, 3, 2}, 0.7f},
                        Case{2, 9, 4, 2, 8, {2, 3, 2, 3}, 0.0f, {4, 1, 2}}}) {
    SCOPED_TRACE(describe(c));
    const OpRun r = run_op(c, DType::f32);
    const std::vector<double> q = to_double(r.q), k = to_double(r.k), v = to_double(r.v), w = to_double(r.dout);
    const auto num_q =
        numerical_grad([&](const std::vector<double>& x) { return weighted_sum(ref_forward(c, x, k, v).out, w); }, q);
    const auto num_k =
        numerical_grad([&](const std::vector<double>& x) { return weighted_sum(ref_forward(c, q, x, v).out, w); }, k);
    const auto num_v =
        numerical_grad([&](const std::vector<double>& x) { return weighted_sum(ref_forward(c, q, k, x).out, w); }, v);
    const double eq = rel_error(r.dq, num_q), ek = rel_error(r.dk, num_k), ev = rel_error(r.dv, num_v);
    std::printf("finite differences %-50s dq %.2e  dk %.2e  dv %.2e\n", describe(c).c_str(), eq, ek, ev);
    EXPECT_LT(eq, 1e-5);
    EXPECT_LT(ek, 1e-5);
    EXPECT_LT(ev, 1e-5);
  }
}

// Rows t0 .. t0 + n of every sequence of x (B, T, H, D), as a new (B, n, H, D) tensor.
Tensor rows_of(const Tensor& x, int64_t t0, int64_t n, const char* tag) {
  const int64_t B = x.size(0), T = x.size(1), row = x.size(2) * x.size(3);
  Tensor out = Tensor::empty({B, n, x.size(2), x.size(3)}, x.dtype(), MemCategory::workspace, tag);
  const Tensor flat_x = x.view({x.numel()});
  Tensor flat_out = out.view({out.numel()});
  for (int64_t b = 0; b < B; ++b)
    flat_out.slice(b * n * row, n * row).copy_from(flat_x.slice((b * T + t0) * row, n * row));
  return out;
}
// The same rows of a (B, T, H, D) double vector.
std::vector<double> rows_of(const Case& c, int64_t H, const std::vector<double>& x, int64_t t0, int64_t n) {
  std::vector<double> out;
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t t = t0; t < t0 + n; ++t)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t e = 0; e < c.D; ++e) out.push_back(x[at(c, H, b, t, h, e)]);
  return out;
}
// lse (B, Hq, T) rows t0 .. t0 + n.
std::vector<double> lse_rows(const Case& c, const std::vector<double>& lse, int64_t t0, int64_t n) {
  std::vector<double> out;
  for (int64_t bh = 0; bh < c.B * c.Hq; ++bh)
    for (int64_t t = t0; t < t0 + n; ++t) out.push_back(lse[size_t(bh * c.T + t)]);
  return out;
}

// A context-parallel rank's view (the head-tail split of a sequence into 4
// chunks: this rank holds chunks 1 and 2, the other chunks 0 and 3): each
// chunk of queries attends, through an AttentionWindow, to the keys of the
// whole sequence up to its own positions, and the keys' gradients of all four
// chunks, accumulated into one buffer, are the whole sequence's. Held to the
// double reference of the whole sequence, as the whole-sequence op is; with
// documents too, some of them spanning chunks.
TEST(Attention, WindowsOfQueryChunksMatchTheWholeSequence) {
  for (const DType dt : {DType::f32, DType::bf16})
    for (const Case& c : {Case{2, 36, 4, 2, 16, kOdd}, Case{1, 64, 4, 1, 64, kSmall}, Case{1, 128, 2, 2, 32, kDefault},
                          Case{2, 36, 4, 2, 16, kOdd, 0.0f, {7, 13, 2}},
                          Case{2, 36, 4, 2, 16, kDocOdd, 0.0f, {7, 13, 2}},
                          Case{1, 128, 2, 2, 32, kDefault, 0.0f, {20, 50}}}) {
      SCOPED_TRACE(describe(c) + " " + dtype_name(dt));
      const int64_t chunk = c.T / 4;
      Tensor q = random_tensor({c.B, c.T, c.Hq, c.D}, dt, "q", 2.0f),
             k = random_tensor({c.B, c.T, c.Hkv, c.D}, dt, "k", 2.0f);
      Tensor v = random_tensor({c.B, c.T, c.Hkv, c.D}, dt, "v"),
             dout = random_tensor({c.B, c.T, c.Hq, c.D}, dt, "dout");
      const std::vector<double> qd = to_double(q), kd = to_double(k), vd = to_double(v), dd = to_double(dout);
      const RefForward f = ref_forward(c, qd, kd, vd);
      const RefGrads g = ref_backward(c, qd, kd, vd, dd);
      Tensor dk = Tensor::zeros(k.shape(), dt, MemCategory::workspace, "dk");
      Tensor dv = Tensor::zeros(v.shape(), dt, MemCategory::workspace, "dv");
      // The whole-sequence tests' bounds (above): f32 1e-5; bf16 5e-3 on out,
      // 1e-4 on lse, 1e-2 on the gradients, which hold with the keys'
      // gradients rounded once per chunk added (measured 2.9e-3 to 3.9e-3).
      const double bound = dt == DType::f32 ? 1e-5 : 5e-3, grad_bound = dt == DType::f32 ? 1e-5 : 1e-2;
      for (const int64_t part : {1, 2, 0, 3}) {
        const int64_t t0 = part * chunk;
        const Tensor qc = rows_of(q, t0, chunk, "q_chunk"), dc = rows_of(dout, t0, chunk, "dout_chunk");
        Tensor out = random_tensor(qc.shape(), dt, "garbage_out", 100.0f);
        Tensor lse = random_tensor({c.B, c.Hq, chunk}, DType::f32, "garbage_lse", 100.0f);
        const AttentionWindow window{t0, 0, documents_of(c)};
        attention_forward(qc, k, v, out, lse, c.scale, c.tiles, window);
        EXPECT_LT(rel_error(out, rows_of(c, c.Hq, f.out, t0, chunk)), bound) << "chunk " << part;
        EXPECT_LT(max_abs_error(to_double(lse), lse_rows(c, f.lse, t0, chunk)), dt == DType::f32 ? 1e-5 : 1e-4);
        Tensor dq = random_tensor(qc.shape(), dt, "garbage_dq", 100.0f);
        // Each chunk's dq is its own (overwritten); the keys' gradients add up over the chunks.
        attention_backward(dc, qc, k, v, out, lse, dq, dk, dv, c.scale, c.tiles, window, {.dq = false, .dkv = true});
        EXPECT_LT(grad_error(dq, rows_of(c, c.Hq, g.dq, t0, chunk)), grad_bound) << "chunk " << part;
      }
      std::printf("%-4s %-62s chunks' dk %.2e  dv %.2e\n", dtype_name(dt), describe(c).c_str(), grad_error(dk, g.dk),
                  grad_error(dv, g.dv));
      EXPECT_LT(grad_error(dk, g.dk), grad_bound);
      EXPECT_LT(grad_error(dv, g.dv), grad_bound);
    }
}

// A block of keys that starts later than key 0 (a ring step of context
// parallelism): the queries attend only to those keys, up to their own
// positions; out and lse are that partial attention's.
TEST(Attention, AWindowOfKeysGivesThePartialAttention) {
  const Case c{1, 24, 2, 1, 16, kOdd};
  const int64_t q_first = 16, k_first = 8, Tq = 8, Tk = 12;  // queries 16..23 over keys 8..19
  Tensor q = random_tensor({c.B, Tq, c.Hq, c.D}, DType::f32, "q", 2.0f);
  Tensor k = random_tensor({c.B, Tk, c.Hkv, c.D}, DType::f32, "k", 2.0f),
         v = random_tensor({c.B, Tk, c.Hkv, c.D}, DType::f32, "v");
  Tensor out = Tensor::empty(q.shape(), DType::f32, MemCategory::workspace, "out");
  Tensor lse = Tensor::empty({c.B, c.Hq, Tq}, DType::f32, MemCategory::workspace, "lse");
  attention_forward(q, k, v, out, lse, 0.0f, c.tiles, AttentionWindow{q_first, k_first});
  const std::vector<double> qd = to_double(q), kd = to_double(k), vd = to_double(v);
  std::vector<double> want_out(qd.size(), 0.0), want_lse;
  const double scale = 1.0 / std::sqrt(double(c.D));
  for (int64_t h = 0; h < c.Hq; ++h)
    for (int64_t t = 0; t < Tq; ++t) {
      const int64_t last = std::min(Tk - 1, q_first + t - k_first);  // keys up to the query's position
      std::vector<double> s;
      double m = -1e300;
      for (int64_t j = 0; j <= last; ++j) {
        double x = 0;
        for (int64_t e = 0; e < c.D; ++e) x += qd[size_t((t * c.Hq + h) * c.D + e)] * kd[size_t(j * c.D + e)];
        s.push_back(x * scale);
        m = std::max(m, x * scale);
      }
      double l = 0;
      for (double& x : s) l += (x = std::exp(x - m));
      for (int64_t j = 0; j <= last; ++j)
        for (int64_t e = 0; e < c.D; ++e)
          want_out[size_t((t * c.Hq + h) * c.D + e)] += s[size_t(j)] / l * vd[size_t(j * c.D + e)];
      want_lse.push_back(m + std::log(l));
    }
  EXPECT_LT(rel_error(out, want_out), 1e-5);
  EXPECT_LT(max_abs_error(to_double(lse), want_lse), 1e-5);
}

// The ring's combination: queries 24..31 of a sequence meet keys 0..31 as
// three blocks (8..23, then 0..7, then their own 24..31, diagonal), each a
// partial attention through a window; merged by their lse, in that order, in
// f32 and from bf16 parts, they give the whole sequence's out and lse.
//
// With documents (sequence 0: lengths 20, 12, so queries 24..31 see only
// keys 20..31 and the block 0..7 gives them nothing: lse −∞, out 0; sequence
// 1: 5, 22, 5, its rows 24..26 reaching back to key 5) the same holds.
TEST(Attention, PartialAttentionsMergeIntoTheWhole) {
  const int64_t B = 2, T = 32, Hq = 4, Hkv = 2, D = 16, q_first = 24, Tq = 8;
  for (const bool with_docs : {false, true})
  for (DType dt : {DType::f32, DType::bf16}) {
    Tensor docs;
    if (with_docs) {
      Tensor tokens = Tensor::zeros({B, T}, DType::i32, MemCategory::workspace, "tokens");
      for (const int64_t last : {19, 32 + 4, 32 + 26}) tokens.data<int32_t>()[last] = 1;
      docs = Tensor::empty({B, 2, T}, DType::i32, MemCategory::workspace, "documents");
      fill_document_bounds(tokens, 1, docs);
      ASSERT_EQ(docs.data<int32_t>()[31], 20);           // sequence 0, position 31: its document starts at 20
      ASSERT_EQ(docs.data<int32_t>()[2 * T + 24], 5);    // sequence 1, position 24: at 5
      ASSERT_EQ(docs.data<int32_t>()[3 * T + 24], 27);   // and ends before 27
    }
    Tensor q = random_tensor({B, T, Hq, D}, dt, "q", 2.0f), k = random_tensor({B, T, Hkv, D}, dt, "k", 2.0f);
    const Tensor v = random_tensor({B, T, Hkv, D}, dt, "v");
    Tensor out = Tensor::empty(q.shape(), dt, MemCategory::workspace, "out");
    Tensor lse = Tensor::empty({B, Hq, T}, DType::f32, MemCategory::workspace, "lse");
    attention_forward(q, k, v, out, lse, 0.0f, {}, AttentionWindow{0, 0, docs});
    // The last 8 query rows of every sequence, as (B, 8, Hq, D).
    auto rows = [&](const Tensor& x, int64_t first, int64_t n) {
      const int64_t H = x.size(2);
      Tensor r = Tensor::empty({B, n, H, D}, x.dtype(), MemCategory::workspace, "rows");
      for (int64_t b = 0; b < B; ++b)
        r.view({B * n * H * D})
            .slice(b * n * H * D, n * H * D)
            .copy_from(x.view({B * T * H * D}).slice((b * T + first) * H * D, n * H * D));
      return r;
    };
    const Tensor q_tail = rows(q, q_first, Tq);
    Tensor acc = Tensor::empty({B, Tq, Hq, D}, DType::f32, MemCategory::workspace, "acc");
    Tensor acc_lse = Tensor::empty({B, Hq, Tq}, DType::f32, MemCategory::workspace, "acc_lse");
    for (int64_t i = 0; i < acc_lse.numel(); ++i) acc_lse.data<float>()[i] = -std::numeric_limits<float>::infinity();
    for (const auto& [k_first, Tk] : std::vector<std::pair<int64_t, int64_t>>{{8, 16}, {0, 8}, {24, 8}}) {
      Tensor part = Tensor::empty({B, Tq, Hq, D}, dt, MemCategory::workspace, "part");
      Tensor part_lse = Tensor::empty({B, Hq, Tq}, DType::f32, MemCategory::workspace, "part_lse");
      attention_forward(q_tail, rows(k, k_first, Tk), rows(v, k_first, Tk), part, part_lse, 0.0f, {},
                        AttentionWindow{q_first, k_first, docs});
      if (with_docs && k_first == 0)  // sequence 0's queries see none of keys 0..7
        for (int64_t h = 0; h < Hq; ++h)
          for (int64_t t = 0; t < Tq; ++t) {
            EXPECT_EQ(part_lse.item_f32(h * Tq + t), -std::numeric_limits<float>::infinity());
            for (int64_t e = 0; e < D; ++e) EXPECT_EQ(to_double(part)[size_t((t * Hq + h) * D + e)], 0.0);
          }
      attention_merge(part, part_lse, acc, acc_lse);
    }
    std::vector<double> want_lse;
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < Hq; ++h)
        for (int64_t t = q_first; t < T; ++t) want_lse.push_back(lse.item_f32((b * Hq + h) * T + t));
    // f32: the same sums in another order. bf16: each part's out is rounded
    // to bf16 before the merge, the whole's once, each at most 2^-9 relative:
    // they differ by at most 2^-8.
    const double bound = dt == DType::f32 ? 1e-5 : std::ldexp(1.0, -8);
    const double e = rel_error(acc, to_double(rows(out, q_first, Tq)));
    std::printf("%s%s: merged out %.2e from the whole's\n", dtype_name(dt), with_docs ? " documents" : "", e);
    EXPECT_LT(e, bound) << dtype_name(dt);
    EXPECT_LT(max_abs_error(to_double(acc_lse), want_lse), 1e-5) << dtype_name(dt);
  }
}

// A documents tensor of one document per sequence gives the causal result bit
// for bit: the same tiles, the same products, the same order of sums.
TEST(Attention, OneDocumentPerSequenceIsBitForBitCausal) {
  for (const DType dt : {DType::f32, DType::bf16})
    for (const Case& c : {Case{2, 300, 4, 2, 64, kDefault}, Case{1, 23, 4, 1, 8, kOdd}, Case{2, 37, 4, 2, 64, kSmall},
                          Case{2, 37, 4, 2, 64, kDocSmall}}) {
      SCOPED_TRACE(describe(c) + " " + dtype_name(dt));
      const OpRun causal = run_op(c, dt);
      Tensor docs = Tensor::empty({c.B, 2, c.T}, DType::i32, MemCategory::workspace, "documents");
      fill_single_document_bounds(docs);
      const AttentionWindow window{0, 0, docs};
      Tensor out = Tensor::empty(causal.out.shape(), dt, MemCategory::workspace, "out");
      Tensor lse = Tensor::empty(causal.lse.shape(), DType::f32, MemCategory::workspace, "lse");
      attention_forward(causal.q, causal.k, causal.v, out, lse, c.scale, c.tiles, window);
      Tensor dq = random_tensor(causal.q.shape(), dt, "garbage_dq", 100.0f);
      Tensor dk = random_tensor(causal.k.shape(), dt, "garbage_dk", 100.0f);
      Tensor dv = random_tensor(causal.v.shape(), dt, "garbage_dv", 100.0f);
      attention_backward(causal.dout, causal.q, causal.k, causal.v, out, lse, dq, dk, dv, c.scale, c.tiles, window);
      EXPECT_EQ(max_abs_error(to_double(out), to_double(causal.out)), 0.0);
      EXPECT_EQ(max_abs_error(to_double(lse), to_double(causal.lse)), 0.0);
      EXPECT_EQ(max_abs_error(to_double(dq), to_double(causal.dq)), 0.0);
      EXPECT_EQ(max_abs_error(to_double(dk), to_double(causal.dk)), 0.0);
      EXPECT_EQ(max_abs_error(to_double(dv), to_double(causal.dv)), 0.0);
    }
}

// The loader's documents: an EOS closes one, the next token starts another;
// position 0 always starts one, and an EOS at the end closes the last.
TEST(DocumentMask, BoundsComeFromTheEosTokens) {
  Tensor tokens = Tensor::zeros({2, 6}, DType::i32, MemCategory::workspace, "tokens");
  int32_t* x = tokens.data<int32_t>();
  x[1] = 9, x[2] = 9, x[5] = 9;  // sequence 0: [0 1] [2] [3 4 5]
  x[6 + 5] = 9;                  // sequence 1: one document ending at the window's end
  Tensor bounds = Tensor::empty({2, 2, 6}, DType::i32, MemCategory::workspace, "bounds");
  fill_document_bounds(tokens, 9, bounds);
  const int32_t* b = bounds.data<int32_t>();
  EXPECT_EQ(std::vector<int32_t>(b, b + 6), (std::vector<int32_t>{0, 0, 2, 3, 3, 3}));
  EXPECT_EQ(std::vector<int32_t>(b + 6, b + 12), (std::vector<int32_t>{2, 2, 3, 6, 6, 6}));
  EXPECT_EQ(std::vector<int32_t>(b + 12, b + 18), (std::vector<int32_t>(6, 0)));
  EXPECT_EQ(std::vector<int32_t>(b + 18, b + 24), (std::vector<int32_t>(6, 6)));
  EXPECT_EQ(documents_in(bounds, 0), 3);
  EXPECT_EQ(documents_in(bounds, 1), 1);
  // Pairs: positions 0..5 see 1, 2, 1, 1, 2, 3 keys; causal would be 1..6.
  EXPECT_EQ(document_attention_pairs(bounds, 0, 0, 6), 10);
  EXPECT_EQ(document_attention_pairs(bounds, 0, 3, 3), 6);
  EXPECT_EQ(document_attention_pairs(bounds, 1, 0, 6), 21);
}

// The work of the tiles the kernels run (score elements of their products),
// on the default grids at T = 512: forward query tiles of 128 (the diagonal
// cap T/4) against key blocks of up to 512, 128²·(1 + 2 + 3 + 4); backward key
// tiles of 128 against query tiles of 256 from the diagonal on, the same sum.
TEST(Attention, TileCountIsTheKernelsWork) {
  const double causal = 128.0 * 128 * (1 + 2 + 3 + 4);
  const AttentionTileCount n = attention_tile_count(1, 512, 512);
  EXPECT_EQ(n.forward, causal);
  EXPECT_EQ(n.backward, causal);
  EXPECT_EQ(n.causal_forward, causal);
  EXPECT_EQ(n.kept(), 1.0);
  // Documents of 128 tokens: four, of at most 4·128 on average, so the
  // document grid of 128 × 128 runs, one tile per document each way.
  Tensor tokens = Tensor::zeros({1, 512}, DType::i32, MemCategory::workspace, "tokens");
  for (int64_t p = 127; p < 512; p += 128) tokens.data<int32_t>()[p] = 1;
  Tensor docs = Tensor::empty({1, 2, 512}, DType::i32, MemCategory::workspace, "documents");
  fill_document_bounds(tokens, 1, docs);
  const AttentionTileCount d = attention_tile_count(1, 512, 512, {}, AttentionWindow{0, 0, docs});
  EXPECT_EQ(d.forward, 4 * 128.0 * 128);
  EXPECT_EQ(d.backward, 4 * 128.0 * 128);
  EXPECT_EQ(d.causal_backward, causal);
  EXPECT_DOUBLE_EQ(d.kept(), 0.4);
  // On the causal grid (document tiles as large as it): query tile i still
  // runs keys from 0 to its end in one block of 512; key tile j only its own queries.
  AttentionTiles coarse;
  coarse.doc = 512;
  const AttentionTileCount c = attention_tile_count(1, 512, 512, coarse, AttentionWindow{0, 0, docs});
  EXPECT_EQ(c.forward, causal);
  EXPECT_EQ(c.backward, 4 * 128.0 * 256 - 128.0 * 128);  // 256-query tiles, the last cut to 128 rows
}

TEST(Attention, RejectsHeadsNotDivisibleByKvHeads) {
  Tensor q = Tensor::zeros({1, 4, 6, 8}, DType::f32, MemCategory::activations, "q");
  Tensor k = Tensor::zeros({1, 4, 4, 8}, DType::f32, MemCategory::activations, "k");
  Tensor out = Tensor::zeros(q.shape(), DType::f32, MemCategory::activations, "out");
  Tensor lse = Tensor::zeros({1, 6, 4}, DType::f32, MemCategory::activations, "lse");
  EXPECT_THROW(attention_forward(q, k, k, out, lse), Error);
}

}  // namespace

// When B·Hkv does not divide over the threads the backward splits key tiles
// between tasks; their dQ partials must still be summed in a fixed order, so
// every run gives the same bits.
TEST(Attention, SplitBackwardIsBitwiseReproducible) {
  const int saved = num_threads();
  set_num_threads(2);
  const int64_t B = 1, T = 300, H = 1, D = 64;
  Tensor q = random_tensor({B, T, H, D}, DType::bf16, "q"), k = random_tensor({B, T, H, D}, DType::bf16, "k");
  Tensor v = random_tensor({B, T, H, D}, DType::bf16, "v"), dout = random_tensor({B, T, H, D}, DType::bf16, "do");
  Tensor out = Tensor::empty({B, T, H, D}, DType::bf16, MemCategory::workspace, "out");
  Tensor lse = Tensor::empty({B, H, T}, DType::f32, MemCategory::workspace, "lse");
  attention_forward(q, k, v, out, lse, 0.0f, AttentionTiles{64, 64, 64, 64});
  std::vector<double> first;
  for (int run = 0; run < 5; ++run) {
    Tensor dq = Tensor::empty({B, T, H, D}, DType::bf16, MemCategory::workspace, "dq");
    Tensor dk = Tensor::empty({B, T, H, D}, DType::bf16, MemCategory::workspace, "dk");
    Tensor dv = Tensor::empty({B, T, H, D}, DType::bf16, MemCategory::workspace, "dv");
    attention_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0f, AttentionTiles{64, 64, 64, 64});
    if (run == 0) first = to_double(dq);
    else EXPECT_EQ(max_abs_error(to_double(dq), first), 0.0) << "run " << run;
  }
  set_num_threads(saved);
}
