// cuDNN SDPA's view of Anvil's attention tensors (ops/sdpa_layout.h), proved
// by a naive attention written from cuDNN's documented semantics that reads
// q, k, v and writes o and the stats through the layout's dims and strides
// alone, on the raw memory of Anvil's tensors, against the CPU
// attention_forward: odd T, grouped-query heads (and multi-query, and
// multi-head), causal; and block-causal through cuDNN's ragged view (the
// documents' pack, the padding mask, token-major stats). The layout must also
// cover every element of Anvil's out and lse exactly once. f32 tensors keep the tolerance tight (the layout,
// in elements, is the same for the bf16 ones cuDNN runs on).
#include "anvil/ops/sdpa_layout.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "anvil/core/error.h"
#include "anvil/ops/attention.h"
#include "test_util.h"
#include "document_bounds.h"

namespace {

using namespace anvil;
using namespace anvil::testing;

// cuDNN's SDPA forward, as documented (cudnn-frontend docs/operations/Attention.md):
// for each [b, h, i] of q's dims, scores s_j = attn_scale · Σ_d q[b,h,i,d]·k[b,h',j,d]
// over keys j, with h' = h / (h_q / h_kv) (grouped-query heads); the diagonal
// band masks keys j > i + right_bound (TOP_LEFT alignment); stats[b,h,i,0] =
// max + ln Σ_j exp(s_j − max); o[b,h,i,:] = Σ_j softmax(s)_j · v[b,h',j,:].
// In double; o and stats go to the offsets their layouts give, into buffers
// of NaN, so an element the layout misses stays NaN.
struct NaiveSdpa {
  std::vector<double> o, stats;
  std::vector<int> writes_o, writes_stats;           // per element, how many times the layout wrote it
  std::vector<double> row_bound_o, row_bound_stats;  // at o's and stats' offsets (see bounds())
};

constexpr double kU = FLT_EPSILON / 2.0;  // f32 unit roundoff

// The error the CPU's f32 attention may make on a row, to first order in u:
// a score is a D-term product (rounded D + 3 times, the log2 e scale
// included), so δs ≤ (D + 3)·u·scale·Σ|q·k|; P = 2^(s − m) then carries
// δs plus the rounding of its argument (u·|s − m| ≤ 2u·max|s|) plus its 2^x
// (taken to 4 ulps); o = Σ P v / Σ P moves by twice P's relative error plus
// the T-term sum's rounding, times max|v|; lse = m + ln Σ P by P's relative
// error, the sum's, and a few roundings of its own value.
struct RowBound {
  double o, lse;
};
RowBound row_bound(double score_magnitude, double max_score, double max_v, double lse, int64_t D, int64_t T) {
  const double p_rel = (D + 3) * kU * score_magnitude + 2 * kU * max_score + 4 * kU;
  return {(2 * p_rel + (T + 5) * kU) * max_v, p_rel + (T + 4) * kU + 4 * kU * std::abs(lse)};
}

// Where each entry b of cuDNN's batch starts in a tensor: b·stride[0], or
// under a ragged layout its ragged offset; and how many of its rows are
// real (the padding mask's seq_len; all s of them when there is none).
struct Entries {
  const int32_t* seq_len = nullptr;
  const int64_t *q_offset = nullptr, *kv_offset = nullptr, *stats_offset = nullptr;
  int64_t base(const CudnnTensorLayout& t, const int64_t* offset, int64_t b) const {
    return offset ? offset[b] : b * t.stride[0];
  }
  int64_t rows(const SdpaLayout& l, int64_t b) const { return seq_len ? seq_len[b] : l.s_q; }
};

// With the padding mask (ragged layouts), rows past an entry's length are
// neither read nor written and its keys past the length are masked; the
// causal band is then top-left within each entry.
NaiveSdpa naive_sdpa(const SdpaLayout& l, const float* q, const float* k, const float* v, const Entries& e,
                     int64_t o_elems, int64_t stats_elems) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  NaiveSdpa r{std::vector<double>(size_t(o_elems), nan), std::vector<double>(size_t(stats_elems), nan),
              std::vector<int>(size_t(o_elems), 0),      std::vector<int>(size_t(stats_elems), 0),
              std::vector<double>(size_t(o_elems), 0),   std::vector<double>(size_t(stats_elems), 0)};
  const int64_t group = l.q.dim[1] / l.k.dim[1];
  for (int64_t b = 0; b < l.q.dim[0]; ++b) {
    const int64_t qb = e.base(l.q, e.q_offset, b), kb = e.base(l.k, e.kv_offset, b),
                  vb = e.base(l.v, e.kv_offset, b), ob = e.base(l.o, e.q_offset, b),
                  sb = e.base(l.stats, e.stats_offset, b), rows = e.rows(l, b);
    for (int64_t h = 0; h < l.q.dim[1]; ++h)
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t hk = h / group;
        const int64_t keys = l.causal_top_left ? std::min(rows, i + l.diagonal_right_bound + 1) : rows;
        std::vector<double> s(static_cast<size_t>(keys));
        double magnitude = 0, max_abs = 0, max_v = 0;
        for (int64_t j = 0; j < keys; ++j) {
          double dot = 0, mag = 0;
          for (int64_t d = 0; d < l.q.dim[3]; ++d) {
            const double x = double(q[qb + l.q.offset(0, h, i, d)]) * double(k[kb + l.k.offset(0, hk, j, d)]);
            dot += x;
            mag += std::abs(x);
          }
          s[size_t(j)] = l.attn_scale * dot;
          magnitude = std::max(magnitude, l.attn_scale * mag);
          max_abs = std::max(max_abs, std::abs(s[size_t(j)]));
          for (int64_t d = 0; d < l.v.dim[3]; ++d)
            max_v = std::max(max_v, std::abs(double(v[vb + l.v.offset(0, hk, j, d)])));
        }
        const double m = *std::max_element(s.begin(), s.end());
        double sum = 0;
        for (const double x : s) sum += std::exp(x - m);
        const double lse = m + std::log(sum);
        const RowBound bound = row_bound(magnitude, max_abs, max_v, lse, l.d, keys);
        const int64_t at = sb + l.stats.offset(0, h, i, 0);
        r.stats[size_t(at)] = lse;
        r.row_bound_stats[size_t(at)] = bound.lse;
        ++r.writes_stats[size_t(at)];
        for (int64_t d = 0; d < l.o.dim[3]; ++d) {
          double acc = 0;
          for (int64_t j = 0; j < keys; ++j)
            acc += std::exp(s[size_t(j)] - lse) * double(v[vb + l.v.offset(0, hk, j, d)]);
          const int64_t oat = ob + l.o.offset(0, h, i, d);
          r.o[size_t(oat)] = acc;
          r.row_bound_o[size_t(oat)] = bound.o;
          ++r.writes_o[size_t(oat)];
        }
      }
  }
  return r;
}

struct Case {
  int64_t B, T, Hq, Hkv, D;
  AttentionTiles tiles = {};
};

}  // namespace

TEST(SdpaLayout, NaiveCudnnAttentionThroughTheLayoutMatchesTheCpuAttention) {
  const Case cases[] = {
      {2, 13, 6, 2, 8},                             // grouped-query, odd T
      {1, 17, 3, 1, 24},                            // multi-query
      {3, 9, 4, 4, 16},                             // multi-head
      {1, 37, 4, 2, 8, {.fwd_q = 8, .fwd_k = 16}},  // several tiles on the CPU
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(::testing::Message() << "B=" << c.B << " T=" << c.T << " Hq=" << c.Hq << " Hkv=" << c.Hkv
                                      << " D=" << c.D);
    const Tensor q = random_tensor({c.B, c.T, c.Hq, c.D}, DType::f32, "sdpa.q");
    const Tensor k = random_tensor({c.B, c.T, c.Hkv, c.D}, DType::f32, "sdpa.k");
    const Tensor v = random_tensor({c.B, c.T, c.Hkv, c.D}, DType::f32, "sdpa.v");
    Tensor out = Tensor::empty({c.B, c.T, c.Hq, c.D}, DType::f32, MemCategory::workspace, "sdpa.out");
    Tensor lse = Tensor::empty({c.B, c.Hq, c.T}, DType::f32, MemCategory::workspace, "sdpa.lse");
    attention_forward(q, k, v, out, lse, 0.0f, c.tiles);

    const SdpaLayout l = sdpa_layout_of(c.B, c.T, c.Hq, c.Hkv, c.D, 0.0f);
    const NaiveSdpa naive = naive_sdpa(l, q.data<float>(), k.data<float>(), v.data<float>(), {}, out.numel(), lse.numel());
    ASSERT_EQ(naive.o.size(), size_t(out.numel()));
    ASSERT_EQ(naive.stats.size(), size_t(lse.numel()));
    double max_o = 0, max_lse = 0, used_o = 0, used_lse = 0;
    for (size_t e = 0; e < naive.o.size(); ++e) {
      ASSERT_EQ(naive.writes_o[e], 1) << "o element " << e << " written " << naive.writes_o[e] << " times";
      const double err = std::abs(double(out.data<float>()[e]) - naive.o[e]);
      ASSERT_LE(err, naive.row_bound_o[e])
          << "out element " << e << ": CPU " << out.data<float>()[e] << ", cuDNN layout " << naive.o[e];
      max_o = std::max(max_o, err);
      used_o = std::max(used_o, err / naive.row_bound_o[e]);
    }
    for (size_t e = 0; e < naive.stats.size(); ++e) {
      ASSERT_EQ(naive.writes_stats[e], 1) << "stats element " << e << " written " << naive.writes_stats[e] << " times";
      const double err = std::abs(double(lse.data<float>()[e]) - naive.stats[e]);
      ASSERT_LE(err, naive.row_bound_stats[e])
          << "lse element " << e << ": CPU " << lse.data<float>()[e] << ", cuDNN layout " << naive.stats[e];
      max_lse = std::max(max_lse, err);
      used_lse = std::max(used_lse, err / naive.row_bound_stats[e]);
    }
    std::printf(
        "B=%ld T=%ld Hq=%ld Hkv=%ld D=%ld: max |out − naive| %.2e (%.0f%% of its bound), max |lse − stats| %.2e "
        "(%.0f%% of its bound)\n",
        long(c.B), long(c.T), long(c.Hq), long(c.Hkv), long(c.D), max_o, 100 * used_o, max_lse, 100 * used_lse);
  }
}

TEST(SdpaLayout, RefusesWhatCudnnSdpaCannotTake) {
  EXPECT_THROW(sdpa_layout_of(1, 8, 6, 4, 8, 0.0f), Error);   // 6 query heads over 4 kv heads
  EXPECT_THROW(sdpa_layout_of(1, 8, 4, 2, 12, 0.0f), Error);  // head dim not a multiple of 8
  EXPECT_NO_THROW(sdpa_layout_of(1, 8, 4, 2, 16, 0.0f));
}

namespace {

template <class T>
const T* array_at(const std::vector<std::byte>& bytes, size_t offset) {
  return reinterpret_cast<const T*>(bytes.data() + offset);
}

}  // namespace

// The ragged batch: one entry per document in token order, the batch and
// length rounded up (the length to at least 64 and at most T), the entries
// past the last empty and starting at the end.
TEST(SdpaLayout, DocumentsBecomeCudnnsRaggedBatch) {
  const Tensor bounds = document_bounds({{5, 1, 7}, {13}}, 13);
  const SdpaDocuments d = sdpa_documents_of(bounds.data<int32_t>(), 2, 13, 13);
  EXPECT_EQ(d.batch, 4);
  EXPECT_EQ(d.max_seq, 13);
  EXPECT_EQ(d.seq_len, (std::vector<int32_t>{5, 1, 7, 13}));
  EXPECT_EQ(d.first_token, (std::vector<int64_t>{0, 5, 6, 13, 26}));

  const Tensor many = document_bounds({{100, 100, 100, 100, 112}, {300, 212}}, 512);
  const SdpaDocuments m = sdpa_documents_of(many.data<int32_t>(), 2, 512, 512);
  EXPECT_EQ(m.batch, 8);
  EXPECT_EQ(m.max_seq, 512) << "the longest (300) rounded up to 512";
  EXPECT_EQ(m.seq_len, (std::vector<int32_t>{100, 100, 100, 100, 112, 300, 212, 0}));
  EXPECT_EQ(m.first_token, (std::vector<int64_t>{0, 100, 200, 300, 400, 512, 812, 1024, 1024}));
  const Tensor short_docs = document_bounds({{10, 20, 482}, {1, 511}}, 512);
  EXPECT_EQ(sdpa_documents_of(short_docs.data<int32_t>(), 2, 512, 512).max_seq, 512);
  const Tensor tiny = document_bounds({{10, 20, 30, 452}}, 512);
  EXPECT_EQ(sdpa_documents_of(tiny.data<int32_t>(), 1, 512, 512).batch, 4);
  const Tensor small = document_bounds({{10, 20, 30, 40}}, 100);
  EXPECT_EQ(sdpa_documents_of(small.data<int32_t>(), 1, 100, 100).max_seq, 64) << "at least 64";
  EXPECT_EQ(sdpa_documents_capacity(2, 13), 32);
  EXPECT_EQ(sdpa_documents_capacity(1, 8192), 8192);

  // Bounds that do not cut the sequence into documents are refused.
  Tensor bad = document_bounds({{5, 8}}, 13);
  bad.data<int32_t>()[5] = 4;  // position 5 claims to start at 4, inside the first document
  EXPECT_THROW(sdpa_documents_of(bad.data<int32_t>(), 1, 13, 13), Error);
}

// The pack: lengths and three offset arrays at 256-byte boundaries, each
// offset the entry's first token times the tensor's elements per token.
TEST(SdpaLayout, ThePackHoldsLengthsAndOffsetsInElements) {
  const int64_t B = 2, T = 13, Hq = 6, Hkv = 2, D = 8;
  const Tensor bounds = document_bounds({{5, 1, 7}, {13}}, T);
  const SdpaDocuments d = sdpa_documents_of(bounds.data<int32_t>(), B, T, T);
  const SdpaLayout l = sdpa_layout_of(B, T, Hq, Hkv, D, 0.0f, d.batch, d.max_seq);
  const int64_t capacity = sdpa_documents_capacity(B, T);
  const SdpaDocumentsPack at = sdpa_documents_pack_of(capacity);
  for (const size_t o : {at.seq_len, at.q_offset, at.kv_offset, at.stats_offset, at.bytes}) EXPECT_EQ(o % 256, 0u);
  EXPECT_GE(at.q_offset, size_t(capacity) * 4);
  EXPECT_GE(at.kv_offset - at.q_offset, size_t(capacity + 1) * 8);
  const std::vector<std::byte> bytes = sdpa_documents_packed(d, l, capacity);
  ASSERT_EQ(bytes.size(), at.bytes);
  for (int64_t n = 0; n < d.batch; ++n) EXPECT_EQ(array_at<int32_t>(bytes, at.seq_len)[n], d.seq_len[size_t(n)]);
  for (int64_t n = 0; n <= d.batch; ++n) {
    EXPECT_EQ(array_at<int64_t>(bytes, at.q_offset)[n], d.first_token[size_t(n)] * Hq * D);
    EXPECT_EQ(array_at<int64_t>(bytes, at.kv_offset)[n], d.first_token[size_t(n)] * Hkv * D);
    EXPECT_EQ(array_at<int64_t>(bytes, at.stats_offset)[n], d.first_token[size_t(n)] * Hq);
  }
  EXPECT_TRUE(l.ragged);
  EXPECT_EQ(l.max_total_seq, B * T);
  EXPECT_EQ(l.stats.stride, (std::array<int64_t, 4>{Hq * d.max_seq, 1, Hq, 1})) << "token-major stats";
  EXPECT_THROW(sdpa_layout_of(B, T, Hq, Hkv, D, 0.0f, 4, T + 1), Error) << "documents longer than the sequence";
}

// Block-causal attention through cuDNN's ragged view: the naive attention
// reads q, k, v and writes o and the stats through the layout and the pack
// alone (each entry's rows from its ragged offset, its length as the padding
// mask, causal within it), on the raw memory of Anvil's tensors, against the
// CPU attention over the same documents. o is Anvil's out element for
// element; the stats are token-major, so stats[(b·T + t)·Hq + h] must be
// Anvil's lse[b, h, t]. Every element is written once; the empty entries past
// the last document write nothing.
TEST(SdpaLayout, NaiveRaggedCudnnAttentionMatchesTheCpuBlockCausalAttention) {
  struct DocCase {
    int64_t T, Hq, Hkv, D;
    std::vector<std::vector<int32_t>> lengths;
    AttentionTiles tiles = {};
  };
  const DocCase cases[] = {
      {13, 6, 2, 8, {{5, 1, 7}, {13}}},                                    // GQA, one sequence one document
      {17, 3, 1, 24, {{1, 1, 1, 14}}},                                     // multi-query, single-token documents
      {37, 4, 2, 8, {{9, 20, 8}, {36, 1}, {37}}, {.fwd_q = 8, .fwd_k = 16, .doc = 8}},  // CPU document grid
  };
  for (const DocCase& c : cases) {
    const auto B = static_cast<int64_t>(c.lengths.size());
    SCOPED_TRACE(::testing::Message() << "B=" << B << " T=" << c.T << " Hq=" << c.Hq << " Hkv=" << c.Hkv
                                      << " D=" << c.D);
    const Tensor q = random_tensor({B, c.T, c.Hq, c.D}, DType::f32, "sdpa.q");
    const Tensor k = random_tensor({B, c.T, c.Hkv, c.D}, DType::f32, "sdpa.k");
    const Tensor v = random_tensor({B, c.T, c.Hkv, c.D}, DType::f32, "sdpa.v");
    const Tensor bounds = document_bounds(c.lengths, c.T);
    Tensor out = Tensor::empty({B, c.T, c.Hq, c.D}, DType::f32, MemCategory::workspace, "sdpa.out");
    Tensor lse = Tensor::empty({B, c.Hq, c.T}, DType::f32, MemCategory::workspace, "sdpa.lse");
    attention_forward(q, k, v, out, lse, 0.0f, c.tiles, AttentionWindow{0, 0, bounds});

    const SdpaDocuments docs = sdpa_documents_of(bounds.data<int32_t>(), B, c.T, c.T);
    const SdpaLayout l = sdpa_layout_of(B, c.T, c.Hq, c.Hkv, c.D, 0.0f, docs.batch, docs.max_seq);
    const int64_t capacity = sdpa_documents_capacity(B, c.T);
    const std::vector<std::byte> pack = sdpa_documents_packed(docs, l, capacity);
    const SdpaDocumentsPack at = sdpa_documents_pack_of(capacity);
    const Entries entries{array_at<int32_t>(pack, at.seq_len), array_at<int64_t>(pack, at.q_offset),
                          array_at<int64_t>(pack, at.kv_offset), array_at<int64_t>(pack, at.stats_offset)};
    const NaiveSdpa naive =
        naive_sdpa(l, q.data<float>(), k.data<float>(), v.data<float>(), entries, out.numel(), lse.numel());
    double max_o = 0, max_lse = 0;
    for (size_t e = 0; e < naive.o.size(); ++e) {
      ASSERT_EQ(naive.writes_o[e], 1) << "o element " << e << " written " << naive.writes_o[e] << " times";
      const double err = std::abs(double(out.data<float>()[e]) - naive.o[e]);
      ASSERT_LE(err, naive.row_bound_o[e])
          << "out element " << e << ": CPU " << out.data<float>()[e] << ", cuDNN ragged layout " << naive.o[e];
      max_o = std::max(max_o, err);
    }
    for (int64_t b = 0; b < B; ++b)
      for (int64_t t = 0; t < c.T; ++t)
        for (int64_t h = 0; h < c.Hq; ++h) {
          const auto token_major = size_t((b * c.T + t) * c.Hq + h);
          const double cpu = lse.data<float>()[(b * c.Hq + h) * c.T + t];
          ASSERT_EQ(naive.writes_stats[token_major], 1) << "stats of b=" << b << " t=" << t << " h=" << h;
          const double err = std::abs(cpu - naive.stats[token_major]);
          ASSERT_LE(err, naive.row_bound_stats[token_major])
              << "lse b=" << b << " h=" << h << " t=" << t << ": CPU " << cpu << ", stats " << naive.stats[token_major];
          max_lse = std::max(max_lse, err);
        }
    std::printf("ragged B=%ld T=%ld, %ld documents in %ld entries of at most %ld: max |out − naive| %.2e, "
                "max |lse − stats| %.2e\n",
                long(B), long(c.T), long(std::count_if(docs.seq_len.begin(), docs.seq_len.end(), [](int32_t n) {
                  return n > 0;
                })),
                long(docs.batch), long(docs.max_seq), max_o, max_lse);
  }
}
