// The cross-entropy head's row work (ops/cuda/cross_entropy_body.h) run on
// the host over the kernels' whole grids, chunk by chunk, against a double
// reference and against the CPU op's own results on the same logits, and
// (skipped without a GPU) the kernels against the host runs bit for bit.
//
// The CPU op's logits are made exact: with w the (V, V) identity, x·wᵀ = x
// in any summation order, so its shard statistics, lse, loss and dx =
// dlogits·w = dlogits (cross_entropy_shard_stats / combine_rows /
// shard_backward, with this test's row block and vocabulary chunk) are the
// row work's alone, on the very logits the bodies read.
//
// Bounds, in units of u = 2^-24 (each rounding within u of its result, exp
// within 2 ulp = 4u). The max and the target's logit are exact. Σ = Σ exp(l −
// max): each term's exponent l − m_t is rounded (u·|l − m_t| ≤ u·|l − max|
// of that term, the running m_t being at least l and at most max: in all
// W = Σ exp(l − max)·|l − max| / Σ), exp 4u, then the additions of its chain
// (kernels: ⌈Cn/256⌉ + 8 per chunk; CPU op: Cn), and per later chunk one
// rescale exp(m_old − m) (u·|m_old − m|, those summing to the max's growth G
// after the first chunk, and 4u + 2u for exp and the fused or unfused
// multiply-add); +1 for the second order:
// εΣ ≤ W + 4 + chain + G + 6·(chunks − 1) + 1.
// lse = max + log Σ: εΣ (absolute), log's 1 ulp (2u·|log Σ|), the addition
// (u·|lse|): E_lse. loss: Σ E_lse over the counted rows, the double sums'
// roundings below it. dlogits (softmax·scale, or (p − 1)·scale at the
// target): p = exp(l − lse) to p·(E_lse + |l − lse| + 4 + 1), −1 one rounding
// of |p − 1|, ·scale one more; floored exponents (l − lse < −86) add
// exp(−86)·scale; subnormal dlogits (·scale) a rounding of half 2^-149 not
// u relative, 2^-149 in all; bf16 dlogits their final rounding.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "anvil/ops/cross_entropy.h"
#include "anvil/ops/cuda/cross_entropy.h"
#include "anvil/ops/cuda/cross_entropy_body.h"
#include "cuda_test_util.h"
#include "kernel_check_util.h"

namespace {

using namespace anvil;
using namespace anvil::testing;
using anvil::kernel::LaunchShape;
using anvil::kernel::ThreadPos;

// Odd everywhere: 7 chunks of 97 entries, the last of 29; two ignored rows.
constexpr int64_t kM = 37, kV = 611, kChunk = 97, kRowBlock = 16;
constexpr int32_t kIgnore = -100;
constexpr float kScale = 1.0f / 35;
const int64_t kChunks = (kV + kChunk - 1) / kChunk;
const double kU = std::ldexp(1.0, -24);

int64_t chunk_width(int64_t c) { return std::min(kChunk, kV - c * kChunk); }

// Logits (M, V), as stored by the CPU op: f32 (from bf16 values in bf16 mode).
template <class T>
struct Problem {
  std::vector<T> x = random_storage<T>(kM * kV, 3.0f, 21);
  std::vector<int32_t> targets;
  Problem() {
    std::mt19937 rng(22);
    for (int64_t i = 0; i < kM; ++i) targets.push_back(static_cast<int32_t>(rng() % kV));
    targets[3] = targets[17] = kIgnore;
    targets[5] = 0, targets[6] = kV - 1, targets[7] = kV - 10;  // the first column, the last chunk's
    x[8 * kV + 100] = stored<T>(40.0f);                          // a far larger logit after the first chunk
    x[9 * kV + 7] = stored<T>(-200.0f);                           // an exponent under the floor
  }
  float logit(int64_t i, int64_t v) const { return static_cast<float>(value_of(x[i * kV + v])); }
  // Chunk c's logits, dense (M, Cn).
  std::vector<float> chunk(int64_t c) const {
    std::vector<float> l;
    for (int64_t i = 0; i < kM; ++i)
      for (int64_t j = 0; j < chunk_width(c); ++j) l.push_back(logit(i, c * kChunk + j));
    return l;
  }
};

struct RowWork {
  std::vector<float> row_max, row_sum, row_target, lse;
  std::vector<float> dlogits_f32;      // (M, V), f32 mode
  std::vector<uint16_t> dlogits_bf16;  // (M, V), bf16 mode
  double loss_sum = 0;
  int64_t num_tokens = 0;
};

// ---- reference and checks ----

struct Reference {
  std::vector<double> max, sum, sum_bound, lse, lse_bound;  // bounds in u
  double loss = 0, loss_bound = 0;
  int64_t tokens = 0;
};

// sum_chain: the additions of a chunk's Σ (see above).
template <class T>
Reference reference(const Problem<T>& pb, double sum_chain) {
  Reference r;
  for (int64_t i = 0; i < kM; ++i) {
    double m = -INFINITY, first_max = -INFINITY;
    for (int64_t v = 0; v < kV; ++v) m = std::max<double>(m, pb.logit(i, v));
    for (int64_t v = 0; v < chunk_width(0); ++v) first_max = std::max<double>(first_max, pb.logit(i, v));
    double s = 0, weighted = 0;  // weighted: Σ exp(l − m)·|l − m|, the exponents' roundings
    for (int64_t v = 0; v < kV; ++v) {
      const double z = pb.logit(i, v) - m;
      s += std::exp(z), weighted += std::exp(z) * std::fabs(z);
    }
    const double eps_sum = weighted / s + 4 + sum_chain + (m - first_max) + 6 * (kChunks - 1) + 1;
    const double lse = m + std::log(s);
    r.max.push_back(m), r.sum.push_back(s), r.sum_bound.push_back(eps_sum);
    r.lse.push_back(lse), r.lse_bound.push_back(eps_sum + 2 * std::fabs(std::log(s)) + std::fabs(lse) + 1);
    if (pb.targets[i] == kIgnore) continue;
    r.loss += lse - pb.logit(i, pb.targets[i]);
    r.loss_bound += r.lse_bound.back() * kU;
    ++r.tokens;
  }
  r.loss_bound += 2 * kM * std::ldexp(1.0, -53) * std::fabs(r.loss) * 4;  // the double sums (a few per row)
  return r;
}

template <class T>
void check_stats(const std::string& what, const Problem<T>& pb, const Reference& ref, const std::vector<float>& row_max,
                 const std::vector<float>& row_sum, const std::vector<float>& row_target) {
  std::vector<float> max_counted, target_counted, sum_counted;
  std::vector<double> max_ref, target_ref, sum_ref, sum_scale;
  for (int64_t i = 0; i < kM; ++i) {
    if (pb.targets[i] == kIgnore) {
      EXPECT_TRUE(row_max[i] == -INFINITY && row_sum[i] == 0 && row_target[i] == 0) << what << " ignored row " << i;
      continue;
    }
    max_counted.push_back(row_max[i]), max_ref.push_back(ref.max[i]);
    target_counted.push_back(row_target[i]), target_ref.push_back(pb.logit(i, pb.targets[i]));
    sum_counted.push_back(row_sum[i]), sum_ref.push_back(ref.sum[i]), sum_scale.push_back(ref.sum[i] * ref.sum_bound[i]);
  }
  const std::vector<double> zero(max_ref.size(), 0.0);
  expect_within(what + " row max (exact)", max_counted, max_ref, zero, 0);
  expect_within(what + " target logit (exact)", target_counted, target_ref, zero, 0);
  expect_within(what + " row Σexp (scale: its bound)", sum_counted, sum_ref, sum_scale, 1);
}

void check_loss(const std::string& what, const Reference& ref, const std::vector<float>& lse, double loss_sum,
                int64_t num_tokens, const std::vector<int32_t>& targets) {
  std::vector<double> lse_scale(kM), lse_ref(ref.lse);
  for (int64_t i = 0; i < kM; ++i) {
    lse_scale[i] = ref.lse_bound[i];
    if (targets[i] == kIgnore) lse_ref[i] = 0, lse_scale[i] = 0;  // written as 0
  }
  expect_within(what + " lse (scale: its bound)", lse, lse_ref, lse_scale, 1);
  EXPECT_EQ(num_tokens, ref.tokens) << what;
  EXPECT_LE(std::fabs(loss_sum - ref.loss), ref.loss_bound) << what << " loss " << loss_sum << " vs " << ref.loss;
  std::printf("%-44s loss error %.3g of bound %.3g\n", (what + " loss").c_str(), std::fabs(loss_sum - ref.loss),
              ref.loss_bound);
}

// dlogits (M, V) against (softmax − onehot)·scale with the reference lse.
template <class T, class D>
void check_dlogits(const std::string& what, const Problem<T>& pb, const Reference& ref, const std::vector<D>& dlogits) {
  std::vector<double> want(dlogits.size()), bound(dlogits.size());
  const double floor_term = std::exp(static_cast<double>(kernel::kCrossEntropyExpMin)) * kScale / kU;
  const double subnormal = std::ldexp(1.0, -149) / kU;
  for (int64_t i = 0; i < kM; ++i)
    for (int64_t v = 0; v < kV; ++v) {
      const size_t at = static_cast<size_t>(i * kV + v);
      if (pb.targets[i] == kIgnore) continue;  // exactly 0
      const double z = pb.logit(i, v) - ref.lse[i], p = std::exp(z);
      const double p_bound = p * (ref.lse_bound[i] + std::fabs(z) + 5);
      if (v == pb.targets[i]) {
        want[at] = (p - 1) * kScale, bound[at] = kScale * (p_bound + std::fabs(p - 1) * 2 + 1) + subnormal;
      } else {
        want[at] = p * kScale,
        bound[at] = kScale * (p_bound + p + 1) + subnormal + (z < kernel::kCrossEntropyExpMin ? floor_term : 0);
      }
    }
  expect_within(what + " dlogits (scale: its bound)", dlogits, want, bound, 1);
}

// ---- host runs ----

// The row work chunk by chunk on the host, each kernel over its grid (or
// `blocks` blocks, when not 0, for the row programs).
template <class T>
RowWork row_work_on_host(const Problem<T>& pb, unsigned blocks) {
  RowWork w;
  w.row_max.assign(kM, NAN), w.row_sum.assign(kM, NAN), w.row_target.assign(kM, NAN), w.lse.assign(kM, NAN);
  LaunchShape rows = kernel::cross_entropy_rows_launch_shape(kM);
  if (blocks) rows.grid.x = blocks;
  for (int64_t c = 0; c < kChunks; ++c) {
    const std::vector<float> l = pb.chunk(c);
    kernel::for_each_block_on_host(rows, [&](kernel::HostBlock& b) {
      kernel::cross_entropy_lse_update_program(b, l.data(), kM, chunk_width(c), c * kChunk, pb.targets.data(), kIgnore,
                                               c == 0, w.row_max.data(), w.row_sum.data(), w.row_target.data());
    });
  }
  kernel::for_each_block_on_host(kernel::cross_entropy_loss_launch_shape(), [&](kernel::HostBlock& b) {
    kernel::cross_entropy_loss_program(b, w.row_max.data(), w.row_sum.data(), w.row_target.data(), pb.targets.data(),
                                       kIgnore, kM, w.lse.data(), &w.loss_sum, &w.num_tokens);
  });
  w.dlogits_f32.assign(kM * kV, NAN), w.dlogits_bf16.assign(kM * kV, 0xffff);
  for (int64_t c = 0; c < kChunks; ++c) {
    const int64_t Cn = chunk_width(c);
    std::vector<float> l = pb.chunk(c);
    std::vector<uint16_t> d16(l.size());
    LaunchShape s = kernel::cross_entropy_dlogits_launch_shape(kM, Cn);
    if (blocks) s.grid.y = blocks;
    kernel::for_each_thread_on_host(s, [&](const ThreadPos& p) {
      kernel::cross_entropy_dlogits_body(p, l.data(), d16.data(), kM, Cn, c * kChunk, pb.targets.data(), kIgnore,
                                         w.lse.data(), kScale);
    });
    kernel::for_each_thread_on_host(s, [&](const ThreadPos& p) {  // f32: in place
      kernel::cross_entropy_dlogits_body(p, l.data(), l.data(), kM, Cn, c * kChunk, pb.targets.data(), kIgnore,
                                         w.lse.data(), kScale);
    });
    for (int64_t i = 0; i < kM; ++i)
      for (int64_t j = 0; j < Cn; ++j) {
        w.dlogits_f32[i * kV + c * kChunk + j] = l[i * Cn + j];
        w.dlogits_bf16[i * kV + c * kChunk + j] = d16[i * Cn + j];
      }
  }
  return w;
}

template <class T>
void check_row_work(const std::string& what, const Problem<T>& pb, const RowWork& w, double sum_chain) {
  const Reference ref = reference(pb, sum_chain);
  check_stats(what, pb, ref, w.row_max, w.row_sum, w.row_target);
  check_loss(what, ref, w.lse, w.loss_sum, w.num_tokens, pb.targets);
  if constexpr (std::is_same_v<T, float>)
    check_dlogits(what, pb, ref, w.dlogits_f32);
  else
    check_dlogits(what, pb, ref, w.dlogits_bf16);
}

const double kKernelSumChain = static_cast<double>((kChunk + kernel::kCrossEntropyThreads - 1) / kernel::kCrossEntropyThreads + 8);

template <class T>
void rows_on_host_and_cpu() {
  const Problem<T> pb;
  const std::string type = type_name<T>();
  const RowWork w = row_work_on_host(pb, 0);
  check_row_work("host " + type, pb, w, kKernelSumChain);
  // Fewer blocks than rows: every bit the same.
  const RowWork few = row_work_on_host(pb, 3);
  expect_same_bits("host " + type + " row Σexp, 3 blocks", few.row_sum, w.row_sum);
  expect_same_bits("host " + type + " lse, 3 blocks", few.lse, w.lse);
  expect_same_bits("host " + type + " dlogits f32, 3 blocks", few.dlogits_f32, w.dlogits_f32);
  expect_same_bits("host " + type + " dlogits bf16, 3 blocks", few.dlogits_bf16, w.dlogits_bf16);
  EXPECT_EQ(std::memcmp(&few.loss_sum, &w.loss_sum, sizeof(double)), 0);

  // The CPU op on the same logits: x·Iᵀ = x.
  std::vector<T> eye(kV * kV, stored<T>(0.0f));
  for (int64_t v = 0; v < kV; ++v) eye[v * kV + v] = stored<T>(1.0f);
  const Tensor x = tensor_of(pb.x, {kM, kV}), wt = tensor_of(eye, {kV, kV}), tg = tensor_of(pb.targets, {kM});
  CrossEntropyOptions opt;
  opt.ignore_index = kIgnore, opt.row_block = kRowBlock, opt.vocab_chunk = kChunk;
  Tensor stats = Tensor::empty({3, kM}, DType::f32, MemCategory::workspace, "stats");
  cross_entropy_shard_stats(x, wt, tg, 0, kV, stats, opt);
  const std::vector<float> st = values<float>(stats);
  const std::vector<float> row_max(st.begin(), st.begin() + kM), row_sum(st.begin() + kM, st.begin() + 2 * kM),
      row_target(st.begin() + 2 * kM, st.end());
  const Reference ref = reference(pb, static_cast<double>(kChunk));
  check_stats("CPU op " + type, pb, ref, row_max, row_sum, row_target);
  Tensor lse = Tensor::empty({kM}, DType::f32, MemCategory::workspace, "lse");
  const CrossEntropyResult r = cross_entropy_combine_rows(tensor_of(row_max, {kM}), stats, tg, lse, opt);
  check_loss("CPU op " + type, ref, values<float>(lse), r.loss_sum, r.num_tokens, pb.targets);
  Tensor dx = Tensor::zeros({kM, kV}, dtype_for<T>(), MemCategory::workspace, "dx");
  Tensor dw = Tensor::zeros({kV, kV}, DType::f32, MemCategory::workspace, "dw");
  cross_entropy_shard_backward(x, wt, tg, 0, lse, kScale, dx, dw, opt);
  check_dlogits("CPU op " + type, pb, ref, values<T>(dx));
}

TEST(CudaCrossEntropyRowsBody, WithinTheBoundLikeTheCpuOp) {
  rows_on_host_and_cpu<float>();
  rows_on_host_and_cpu<uint16_t>();
}

// ---- the kernels ----

template <class T>
void rows_on_gpu() {
  const Problem<T> pb;
  const std::string type = type_name<T>();
  const RowWork host = row_work_on_host(pb, 0);
  const DeviceArray<int32_t> targets(pb.targets);
  const DeviceArray<float> row_max{std::vector<float>(kM)}, row_sum{std::vector<float>(kM)},
      row_target{std::vector<float>(kM)}, lse{std::vector<float>(kM)};
  const DeviceArray<double> loss{std::vector<double>(1)};
  const DeviceArray<int64_t> tokens{std::vector<int64_t>(1)};
  for (int64_t c = 0; c < kChunks; ++c) {
    const DeviceArray<float> l(pb.chunk(c));
    cross_entropy_lse_update_cuda(l.get(), kM, chunk_width(c), c * kChunk, targets.get(), kIgnore, c == 0,
                                  row_max.get(), row_sum.get(), row_target.get(), nullptr);
  }
  cross_entropy_loss_cuda(row_max.get(), row_sum.get(), row_target.get(), targets.get(), kIgnore, kM, lse.get(),
                          loss.get(), tokens.get(), nullptr);
  RowWork gpu{row_max.download(), row_sum.download(), row_target.download(), lse.download(), {}, {},
              loss.download()[0], tokens.download()[0]};
  gpu.dlogits_f32.resize(kM * kV), gpu.dlogits_bf16.resize(kM * kV);
  for (int64_t c = 0; c < kChunks; ++c) {
    const int64_t Cn = chunk_width(c);
    const DeviceArray<float> l(pb.chunk(c));
    const DeviceArray<uint16_t> d16{std::vector<uint16_t>(kM * Cn)};
    cross_entropy_dlogits_cuda(l.get(), d16.get(), kM, Cn, c * kChunk, targets.get(), kIgnore, lse.get(), kScale,
                               nullptr);
    cross_entropy_dlogits_cuda(l.get(), l.get(), kM, Cn, c * kChunk, targets.get(), kIgnore, lse.get(), kScale,
                               nullptr);
    const std::vector<float> f = l.download();
    const std::vector<uint16_t> b = d16.download();
    for (int64_t i = 0; i < kM; ++i)
      for (int64_t j = 0; j < Cn; ++j)
        gpu.dlogits_f32[i * kV + c * kChunk + j] = f[i * Cn + j], gpu.dlogits_bf16[i * kV + c * kChunk + j] = b[i * Cn + j];
  }
  check_row_work("GPU " + type, pb, gpu, kKernelSumChain);
  expect_same_bits("GPU vs host " + type + " row max", gpu.row_max, host.row_max);
  expect_same_bits("GPU vs host " + type + " row Σexp", gpu.row_sum, host.row_sum);
  expect_same_bits("GPU vs host " + type + " target logit", gpu.row_target, host.row_target);
  expect_same_bits("GPU vs host " + type + " lse", gpu.lse, host.lse);
  expect_same_bits("GPU vs host " + type + " dlogits f32", gpu.dlogits_f32, host.dlogits_f32);
  expect_same_bits("GPU vs host " + type + " dlogits bf16", gpu.dlogits_bf16, host.dlogits_bf16);
  EXPECT_EQ(std::memcmp(&gpu.loss_sum, &host.loss_sum, sizeof(double)), 0) << gpu.loss_sum << " vs " << host.loss_sum;
  EXPECT_EQ(gpu.num_tokens, host.num_tokens);
}

TEST(CudaCrossEntropyRowsKernel, WithinTheBoundAndTheHostRunsBits) {
  SKIP_WITHOUT_GPU();
  rows_on_gpu<float>();
  rows_on_gpu<uint16_t>();
}

}  // namespace
