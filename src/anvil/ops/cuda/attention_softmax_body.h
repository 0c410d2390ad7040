// The fp32 attention's causal row softmax (kernel_body.h), for GPU parity
// runs whose products (S = Q·Kᵀ, O = P·V and the backward's) go through
// cuBLASLt: over a (rows, T) f32 score matrix whose row r is query t = r mod T
// of one (batch, head), keys j ≤ t attended (under documents, keys
// first_key[r] ≤ j ≤ t: the row's document's; first_key null means 0):
//   forward   P_j = exp(z_j − lse) (0 outside the keys), z_j = scale·S_j,
//             lse = log Σ_j exp(z_j) over the keys (natural log, as
//             ops/attention.h's lse)
//   backward  dS_j = scale·P_j·(dP_j − Σ_k dP_k·P_k) (the raw scores' gradient;
//             scale 1 gives the scaled scores')
// One block per row; the max, Σ and the dot through block_max and block_sum,
// so the host runs give the device's bits.
#pragma once
#include <cstdint>

#include "anvil/ops/cuda/kernel_body.h"

namespace anvil::kernel {

constexpr unsigned kAttentionSoftmaxThreads = 256;
constexpr unsigned kAttentionSoftmaxMaxBlocks = 65535;

inline LaunchShape attention_softmax_launch_shape(int64_t rows) {
  return {{blocks_for(rows, 1, kAttentionSoftmaxMaxBlocks), 1}, {kAttentionSoftmaxThreads, 1}};
}

// scores, probs (rows, T); lse (rows); first_key (rows) or null. probs may be scores.
template <class Block>
ANVIL_HD void attention_softmax_forward_program(Block& block, const float* scores, float* probs, float* lse,
                                                int64_t rows, int64_t T, float scale, const int32_t* first_key) {
  for (int64_t r = block.index(); r < rows; r += block.count()) {
    const float* s = scores + r * T;
    float* p = probs + r * T;
    const int64_t first = first_key ? first_key[r] : 0, keys = r % T + 1;
    const float m = block.max([&](const ThreadPos& q) {
      float acc = -INFINITY;
      for (int64_t j = first + q.thread_in_block(); j < keys; j += q.threads_per_block())
        acc = max_f32(acc, mul_rn(s[j], scale));
      return acc;
    });
    const float sum = block.template sum<float>([&](const ThreadPos& q) {
      float acc = 0;
      for (int64_t j = first + q.thread_in_block(); j < keys; j += q.threads_per_block())
        acc = acc + exp_f32(mul_rn(s[j], scale) - m);
      return acc;
    });
    block.each([&](const ThreadPos& q) {
      if (q.thread_in_block() == 0) lse[r] = m + log_f32(sum);
      for (int64_t j = q.thread_in_block(); j < T; j += q.threads_per_block())
        p[j] = j >= first && j < keys ? div_rn(exp_f32(mul_rn(s[j], scale) - m), sum) : 0.0f;
    });
  }
}

// probs, dprobs, dscores (rows, T); first_key (rows) or null. dscores may be dprobs.
template <class Block>
ANVIL_HD void attention_softmax_backward_program(Block& block, const float* probs, const float* dprobs, float* dscores,
                                                 int64_t rows, int64_t T, float scale, const int32_t* first_key) {
  for (int64_t r = block.index(); r < rows; r += block.count()) {
    const float *p = probs + r * T, *dp = dprobs + r * T;
    float* ds = dscores + r * T;
    const int64_t first = first_key ? first_key[r] : 0, keys = r % T + 1;
    const float dot = block.template sum<float>([&](const ThreadPos& q) {
      float acc = 0;
      for (int64_t j = first + q.thread_in_block(); j < keys; j += q.threads_per_block()) acc = fma_rn(dp[j], p[j], acc);
      return acc;
    });
    block.each([&](const ThreadPos& q) {
      for (int64_t j = q.thread_in_block(); j < T; j += q.threads_per_block())
        ds[j] = j >= first && j < keys ? mul_rn(scale, mul_rn(p[j], dp[j] - dot)) : 0.0f;
    });
  }
}

}  // namespace anvil::kernel
