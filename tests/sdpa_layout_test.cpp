// cuDNN SDPA's view of Anvil's attention tensors (ops/sdpa_layout.h), proved
// by a naive attention written from cuDNN's documented semantics that reads
// q, k, v and writes o and the stats through the layout's dims and strides
// alone, on the raw memory of Anvil's tensors, against the CPU
// attention_forward: odd T, grouped-query heads (and multi-query, and
// multi-head), causal. The layout must also cover every element of Anvil's
// out and lse exactly once. f32 tensors keep the tolerance tight (the layout,
// in elements, is the same for the bf16 ones cuDNN runs on).
#include "anvil/ops/sdpa_layout.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "anvil/core/error.h"
#include "anvil/ops/attention.h"
#include "test_util.h"

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

NaiveSdpa naive_sdpa(const SdpaLayout& l, const float* q, const float* k, const float* v) {
  const int64_t o_elems = l.b * l.h_q * l.s_q * l.d, stats_elems = l.b * l.h_q * l.s_q;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  NaiveSdpa r{std::vector<double>(size_t(o_elems), nan), std::vector<double>(size_t(stats_elems), nan),
              std::vector<int>(size_t(o_elems), 0),      std::vector<int>(size_t(stats_elems), 0),
              std::vector<double>(size_t(o_elems), 0),   std::vector<double>(size_t(stats_elems), 0)};
  const int64_t group = l.q.dim[1] / l.k.dim[1];
  for (int64_t b = 0; b < l.q.dim[0]; ++b)
    for (int64_t h = 0; h < l.q.dim[1]; ++h)
      for (int64_t i = 0; i < l.q.dim[2]; ++i) {
        const int64_t hk = h / group;
        const int64_t keys = l.causal_top_left ? std::min(l.k.dim[2], i + l.diagonal_right_bound + 1) : l.k.dim[2];
        std::vector<double> s(static_cast<size_t>(keys));
        double magnitude = 0, max_abs = 0, max_v = 0;
        for (int64_t j = 0; j < keys; ++j) {
          double dot = 0, mag = 0;
          for (int64_t d = 0; d < l.q.dim[3]; ++d) {
            const double x = double(q[l.q.offset(b, h, i, d)]) * double(k[l.k.offset(b, hk, j, d)]);
            dot += x;
            mag += std::abs(x);
          }
          s[size_t(j)] = l.attn_scale * dot;
          magnitude = std::max(magnitude, l.attn_scale * mag);
          max_abs = std::max(max_abs, std::abs(s[size_t(j)]));
          for (int64_t d = 0; d < l.v.dim[3]; ++d)
            max_v = std::max(max_v, std::abs(double(v[l.v.offset(b, hk, j, d)])));
        }
        const double m = *std::max_element(s.begin(), s.end());
        double sum = 0;
        for (const double x : s) sum += std::exp(x - m);
        const double lse = m + std::log(sum);
        const RowBound bound = row_bound(magnitude, max_abs, max_v, lse, l.d, keys);
        const int64_t at = l.stats.offset(b, h, i, 0);
        r.stats[size_t(at)] = lse;
        r.row_bound_stats[size_t(at)] = bound.lse;
        ++r.writes_stats[size_t(at)];
        for (int64_t d = 0; d < l.o.dim[3]; ++d) {
          double acc = 0;
          for (int64_t j = 0; j < keys; ++j) acc += std::exp(s[size_t(j)] - lse) * double(v[l.v.offset(b, hk, j, d)]);
          const int64_t oat = l.o.offset(b, h, i, d);
          r.o[size_t(oat)] = acc;
          r.row_bound_o[size_t(oat)] = bound.o;
          ++r.writes_o[size_t(oat)];
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
    const NaiveSdpa naive = naive_sdpa(l, q.data<float>(), k.data<float>(), v.data<float>());
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
