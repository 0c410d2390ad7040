// The fp32 attention's causal row softmax (ops/cuda/attention_softmax_body.h)
// run on the host over the kernels' grids against a double reference and the
// CPU attention's lse, and (skipped without a GPU) the kernels against the
// host runs bit for bit. Under documents (each row's first key) every row is
// proved to be, bit for bit, the causal row of its document's keys shifted to
// the start (so the bounds below carry over), with P and dS exactly 0 outside
// the document; the kernels again give the host runs' bits.
//
// The CPU attention is given scores the test knows exactly: head_dim 1 and
// bf16-valued q and k, so every q_t·k_j is exact in f32, and a power-of-two
// scale. Bounds, in units of u = 2^-24 (exp within 2 ulp = 4u):
//   kernels: z = scale·S is exact here (u·|z| in general), z − m rounds
//   (u·|z − m|; over a row W = Σ e^(z−m)·|z − m| / Σ), exp 4, the chain of
//   additions (⌈T/256⌉ + 8), +1 second order: εΣ = W + 4 + chain + 1.
//   lse = m + log Σ: εΣ + 2·|log Σ| (logf's ulp) + |lse| (the addition).
//   P_j = e^(z_j − m)/Σ: (|z_j − m| + 4 + εΣ + 1 + 1)·P_j.
//   dS_j = scale·P_j·(dP_j − δ), δ = Σ dP·P with the chain + 1 (fused steps)
//   relative to Σ|dP·P|: |scale·P_j|·(3·|dP_j − δ| + (chain + 2)·Σ|dP·P|).
//   Far down the softmax P and dS are subnormal, where a rounding is within
//   half of 2^-149 rather than u relative: P adds 3·2^-149 (exp's 2 ulp there,
//   then the division's half), dS 2^-149 (its two products).
//   The CPU attention (base 2, flash-style online softmax over key tiles) is
//   held to the same form with what any order and tiling may do: its
//   exponents rounded twice more (scale·log2 e, the subtraction:
//   3·W·log2 e), a chain of T additions and up to T rescales of 6 each, its
//   lse converted from base 2 (3·|lse|).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "anvil/ops/attention.h"
#include "anvil/ops/cuda/attention_softmax.h"
#include "anvil/ops/cuda/attention_softmax_body.h"
#include "cuda_test_util.h"
#include "kernel_check_util.h"

namespace {

using namespace anvil;
using namespace anvil::testing;
using anvil::kernel::LaunchShape;

// T odd and over one block's threads: queries past 255 see two keys per thread.
constexpr int64_t kB = 2, kH = 3, kT = 299, kRows = kB * kH * kT;
constexpr float kScale = 0.125f;
const double kU = std::ldexp(1.0, -24), kSubnormalUlp = std::ldexp(1.0, -149);

struct Scores {
  std::vector<float> q = bf16_valued(kB * kT * kH, 31), k = bf16_valued(kB * kT * kH, 32);
  std::vector<float> s;  // (B, H, T, T): row (b, h, t), exact products
  Scores() : s(static_cast<size_t>(kRows * kT)) {
    for (int64_t b = 0; b < kB; ++b)
      for (int64_t h = 0; h < kH; ++h)
        for (int64_t t = 0; t < kT; ++t)
          for (int64_t j = 0; j < kT; ++j)
            s[(((b * kH + h) * kT) + t) * kT + j] = q[(b * kT + t) * kH + h] * k[(b * kT + j) * kH + h];
  }
  static std::vector<float> bf16_valued(int64_t n, uint32_t seed) {
    std::vector<float> v;
    for (uint16_t x : random_storage<uint16_t>(n, 6.0f, seed)) v.push_back(bf16::to_float(x));
    return v;
  }
};

struct RowRef {
  std::vector<double> lse, lse_bound, eps_sum, max;
};

// exponent_weight: u per unit of |z − m| (kernels 1; the CPU 3·log2 e); chain,
// rescales, lse_roundings as above.
RowRef row_reference(const Scores& sc, double exponent_weight, double chain, double rescales, double lse_roundings) {
  RowRef r;
  for (int64_t row = 0; row < kRows; ++row) {
    const float* s = sc.s.data() + row * kT;
    const int64_t keys = row % kT + 1;
    double m = -INFINITY, sum = 0, w = 0;
    for (int64_t j = 0; j < keys; ++j) m = std::max<double>(m, kScale * s[j]);
    for (int64_t j = 0; j < keys; ++j) {
      const double z = kScale * s[j] - m;
      sum += std::exp(z), w += std::exp(z) * std::fabs(z);
    }
    const double eps_sum = exponent_weight * w / sum + 4 + chain + 6 * rescales + 1;
    const double lse = m + std::log(sum);
    r.max.push_back(m), r.eps_sum.push_back(eps_sum), r.lse.push_back(lse);
    r.lse_bound.push_back(eps_sum + 2 * std::fabs(std::log(sum)) + lse_roundings * std::fabs(lse) + 1);
  }
  return r;
}

const double kChain = static_cast<double>((kT + kernel::kAttentionSoftmaxThreads - 1) / kernel::kAttentionSoftmaxThreads + 8);

void check_lse(const std::string& what, const std::vector<float>& lse, const RowRef& ref) {
  expect_within(what + " lse (scale: its bound)", lse, ref.lse, ref.lse_bound, 1);
}

void check_probs(const std::string& what, const Scores& sc, const RowRef& ref, const std::vector<float>& p) {
  std::vector<double> want(p.size()), bound(p.size());
  for (int64_t row = 0; row < kRows; ++row)
    for (int64_t j = 0; j <= row % kT; ++j) {
      const size_t at = static_cast<size_t>(row * kT + j);
      const double z = kScale * sc.s[at] - ref.max[row];
      want[at] = std::exp(kScale * sc.s[at] - ref.lse[row]);
      bound[at] = want[at] * (std::fabs(z) + 4 + ref.eps_sum[row] + 2) + 3 * kSubnormalUlp / kU;
    }
  expect_within(what + " P (scale: its bound)", p, want, bound, 1);
}

void check_dscores(const std::string& what, const std::vector<float>& p, const std::vector<float>& dp,
                   const std::vector<float>& ds) {
  std::vector<double> want(ds.size()), bound(ds.size());
  for (int64_t row = 0; row < kRows; ++row) {
    double dot = 0, dot_abs = 0;
    for (int64_t j = 0; j <= row % kT; ++j) {
      const size_t at = static_cast<size_t>(row * kT + j);
      dot += static_cast<double>(dp[at]) * p[at], dot_abs += std::fabs(static_cast<double>(dp[at]) * p[at]);
    }
    for (int64_t j = 0; j <= row % kT; ++j) {
      const size_t at = static_cast<size_t>(row * kT + j);
      want[at] = kScale * p[at] * (dp[at] - dot);
      bound[at] = std::fabs(kScale * p[at]) * (3 * std::fabs(dp[at] - dot) + (kChain + 2) * dot_abs) + kSubnormalUlp / kU;
    }
  }
  expect_within(what + " dS (scale: its bound)", ds, want, bound, 1);
}

struct SoftmaxRun {
  std::vector<float> p, lse, ds;
};

// On the host over a grid of `blocks` (0: the kernels'); P and dS in place.
// first_key (kRows) masks each row to its document's keys; null: causal.
SoftmaxRun softmax_on_host(const Scores& sc, const std::vector<float>& dp, unsigned blocks,
                           const int32_t* first_key = nullptr) {
  LaunchShape s = kernel::attention_softmax_launch_shape(kRows);
  if (blocks) s.grid.x = blocks;
  SoftmaxRun r{sc.s, std::vector<float>(kRows, NAN), dp};
  kernel::for_each_block_on_host(s, [&](kernel::HostBlock& b) {
    kernel::attention_softmax_forward_program(b, r.p.data(), r.p.data(), r.lse.data(), kRows, kT, kScale, first_key);
  });
  kernel::for_each_block_on_host(s, [&](kernel::HostBlock& b) {
    kernel::attention_softmax_backward_program(b, r.p.data(), r.ds.data(), r.ds.data(), kRows, kT, kScale, first_key);
  });
  return r;
}

std::vector<float> random_dprobs() { return random_storage<float>(kRows * kT, 1.0f, 33); }

TEST(CudaAttentionSoftmaxBody, WithinTheBoundLikeTheCpuAttention) {
  const Scores sc;
  const std::vector<float> dp = random_dprobs();
  const RowRef ref = row_reference(sc, 1, kChain, 0, 1);
  const SoftmaxRun host = softmax_on_host(sc, dp, 0);
  check_lse("host", host.lse, ref);
  check_probs("host", sc, ref, host.p);
  for (int64_t row = 0; row < kRows; ++row)
    for (int64_t j = row % kT + 1; j < kT; ++j) ASSERT_EQ(host.p[row * kT + j], 0.0f) << "P past the query";
  check_dscores("host", host.p, dp, host.ds);
  const SoftmaxRun few = softmax_on_host(sc, dp, 7);
  expect_same_bits("host P, 7 blocks", few.p, host.p);
  expect_same_bits("host lse, 7 blocks", few.lse, host.lse);
  expect_same_bits("host dS, 7 blocks", few.ds, host.ds);

  const Tensor q = tensor_of(sc.q, {kB, kT, kH, 1}), k = tensor_of(sc.k, {kB, kT, kH, 1});
  Tensor out = Tensor::zeros({kB, kT, kH, 1}, DType::f32, MemCategory::workspace, "out");
  Tensor lse = Tensor::zeros({kB, kH, kT}, DType::f32, MemCategory::workspace, "lse");
  attention_forward(q, k, k, out, lse, kScale);
  check_lse("CPU attention", values<float>(lse), row_reference(sc, 3 * M_LOG2E, kT, kT, 3));
}

TEST(CudaAttentionSoftmaxKernel, WithinTheBoundAndTheHostRunsBits) {
  SKIP_WITHOUT_GPU();
  const Scores sc;
  const std::vector<float> dp = random_dprobs();
  const SoftmaxRun host = softmax_on_host(sc, dp, 0);
  const DeviceArray<float> s(sc.s), lse{std::vector<float>(kRows)}, d(dp);
  attention_softmax_forward_cuda(s.get(), s.get(), lse.get(), kRows, kT, kScale, nullptr, nullptr);
  attention_softmax_backward_cuda(s.get(), d.get(), d.get(), kRows, kT, kScale, nullptr, nullptr);
  const RowRef ref = row_reference(sc, 1, kChain, 0, 1);
  const std::vector<float> p = s.download(), l = lse.download(), ds = d.download();
  check_lse("GPU", l, ref);
  check_probs("GPU", sc, ref, p);
  check_dscores("GPU", p, dp, ds);
  expect_same_bits("GPU vs host P", p, host.p);
  expect_same_bits("GPU vs host lse", l, host.lse);
  expect_same_bits("GPU vs host dS", ds, host.ds);
}

// ---- Documents: each row's first key ----
//
// Under first_key a row r (query t = r mod T, first key f ≤ t) is, bit for
// bit, the causal row of query t − f holding the scores s[f..t] at 0..t − f:
// its reductions run j = f + thread, f + thread + threads, ... below t + 1,
// so each thread takes the very elements, in the same order, that it takes
// at j − f in the shifted causal row, and the block combines the same
// partials in the same tree. The backward likewise, its probs and dprobs
// shifted alike. Outside f..t P and dS are exactly 0.

// Sequence 0 in documents of 40, 1 and 258 tokens (f = t on the 1 and on
// every document's first token; the 258 puts shifted rows past one block's
// 256 threads), sequence 1 in one (f = 0 throughout).
const std::vector<int32_t> kDocumentLengths[kB] = {{40, 1, 258}, {299}};

// Each row's first key, its query's document's start, for every head (as
// the GPU attention passes them: ops/attention_gpu.cpp).
std::vector<int32_t> first_keys() {
  std::vector<int32_t> first(static_cast<size_t>(kRows));
  for (int64_t b = 0; b < kB; ++b) {
    std::vector<int32_t> start_of(static_cast<size_t>(kT));
    int32_t begin = 0;
    for (const int32_t n : kDocumentLengths[b]) {
      for (int32_t t = begin; t < begin + n; ++t) start_of[t] = begin;
      begin += n;
    }
    EXPECT_EQ(begin, kT) << "sequence " << b << "'s documents";
    for (int64_t h = 0; h < kH; ++h)
      for (int64_t t = 0; t < kT; ++t) first[(b * kH + h) * kT + t] = start_of[t];
  }
  return first;
}

// The causal programs on one row of n keys: row n − 1 (query n − 1) of an
// (n, T) matrix, the only row read or written, run by the block of the
// causal launch over n rows that owns it, the last (the grid has n blocks, so
// that block's grid-stride loop visits no other row). Past its n keys the
// row holds NaN, which a causal row never reads.
class CausalRow {
 public:
  // P's row (0 past n) and the lse for the scores v[0..n).
  const float* forward(const float* v, int64_t n, float& lse) {
    place(in_, v, n);
    run(n, [&](kernel::HostBlock& b) {
      kernel::attention_softmax_forward_program(b, in_.data(), out_.data(), lse_.data(), n, kT, kScale, nullptr);
    });
    lse = lse_[n - 1];
    return out_.data() + (n - 1) * kT;
  }
  // dS's row for the probs p[0..n) and dprobs dp[0..n).
  const float* backward(const float* p, const float* dp, int64_t n) {
    place(in_, p, n);
    place(din_, dp, n);
    run(n, [&](kernel::HostBlock& b) {
      kernel::attention_softmax_backward_program(b, in_.data(), din_.data(), out_.data(), n, kT, kScale, nullptr);
    });
    return out_.data() + (n - 1) * kT;
  }

 private:
  static void place(std::vector<float>& m, const float* v, int64_t n) {
    float* row = m.data() + (n - 1) * kT;
    std::fill(row, row + kT, NAN);
    std::copy(v, v + n, row);
  }
  template <class Program>
  static void run(int64_t n, Program&& program) {
    const LaunchShape s = kernel::attention_softmax_launch_shape(n);
    EXPECT_EQ(s.grid.x, static_cast<unsigned>(n)) << "a block per row";
    kernel::HostBlock block(s, s.grid.x - 1);
    program(block);
  }
  std::vector<float> in_ = std::vector<float>(kT * kT), din_ = std::vector<float>(kT * kT),
                     out_ = std::vector<float>(kT * kT, NAN), lse_ = std::vector<float>(kT, NAN);
};

// What a run under first_key must give: each row r as the causal row of its
// scores s[f..t] put back at f..t, 0 elsewhere; the backward's from the
// document run's probs `doc.p` and the dprobs dp, shifted alike.
SoftmaxRun shifted_causal(const Scores& sc, const std::vector<float>& dp, const SoftmaxRun& doc,
                          const std::vector<int32_t>& first_key) {
  SoftmaxRun want{std::vector<float>(sc.s.size(), 0.0f), std::vector<float>(kRows, NAN),
                  std::vector<float>(sc.s.size(), 0.0f)};
  CausalRow causal;
  for (int64_t r = 0; r < kRows; ++r) {
    const int64_t t = r % kT, f = first_key[r], n = t - f + 1, at = r * kT + f;
    const float* p = causal.forward(sc.s.data() + at, n, want.lse[r]);
    std::copy(p, p + n, want.p.begin() + at);
    const float* ds = causal.backward(doc.p.data() + at, dp.data() + at, n);
    std::copy(ds, ds + n, want.ds.begin() + at);
  }
  return want;
}

TEST(CudaAttentionSoftmaxBody, UnderDocumentsEachRowIsItsDocumentsCausalRow) {
  const Scores sc;
  const std::vector<float> dp = random_dprobs();
  const std::vector<int32_t> first = first_keys();
  int64_t from_zero = 0, on_the_query = 0, past_a_block = 0;
  for (int64_t r = 0; r < kRows; ++r) {
    from_zero += first[r] == 0 && r % kT > 0;
    on_the_query += first[r] == r % kT && r % kT > 0;
    past_a_block += (r % kT - first[r] + 1) > kernel::kAttentionSoftmaxThreads;
  }
  EXPECT_GT(from_zero, 0) << "rows with f = 0 < t";
  EXPECT_GT(on_the_query, 0) << "rows with f = t > 0";
  EXPECT_GT(past_a_block, 0) << "rows of more keys than a block's threads";

  const SoftmaxRun doc = softmax_on_host(sc, dp, 0, first.data());
  const SoftmaxRun want = shifted_causal(sc, dp, doc, first);
  expect_same_bits("host P vs the shifted causal rows' (0 outside the document)", doc.p, want.p);
  expect_same_bits("host lse vs the shifted causal rows'", doc.lse, want.lse);
  expect_same_bits("host dS vs the shifted causal rows' (0 outside the document)", doc.ds, want.ds);
  const SoftmaxRun few = softmax_on_host(sc, dp, 7, first.data());
  expect_same_bits("host P, 7 blocks", few.p, want.p);
  expect_same_bits("host lse, 7 blocks", few.lse, want.lse);
  expect_same_bits("host dS, 7 blocks", few.ds, want.ds);
}

TEST(CudaAttentionSoftmaxKernel, UnderDocumentsGivesTheHostRunsBits) {
  SKIP_WITHOUT_GPU();
  const Scores sc;
  const std::vector<float> dp = random_dprobs();
  const std::vector<int32_t> first = first_keys();
  const SoftmaxRun host = softmax_on_host(sc, dp, 0, first.data());
  const DeviceArray<float> s(sc.s), lse{std::vector<float>(kRows)}, d(dp);
  const DeviceArray<int32_t> first_d(first);
  attention_softmax_forward_cuda(s.get(), s.get(), lse.get(), kRows, kT, kScale, first_d.get(), nullptr);
  attention_softmax_backward_cuda(s.get(), d.get(), d.get(), kRows, kT, kScale, first_d.get(), nullptr);
  expect_same_bits("GPU vs host P under documents", s.download(), host.p);
  expect_same_bits("GPU vs host lse under documents", lse.download(), host.lse);
  expect_same_bits("GPU vs host dS under documents", d.download(), host.ds);
}

}  // namespace
