// The fused LM head + cross-entropy's row work (kernel_body.h), the CUDA twins
// of what ops/cross_entropy.cpp does between its products (those run through
// cuBLASLt): the head runs row blocks × vocabulary chunks, and per chunk of f32
// logits (Bn rows of Cn, dense, row stride Cn, as the CPU op stores them)
//   pass 1: each row's online log-sum-exp: its running max and Σ exp(logit −
//           max), and its target's logit when the target is in the chunk;
//   then:   each row's lse = max + log Σ and loss = lse − logit[target],
//           summed over the rows in double;
//   pass 2: dlogits = (softmax − onehot(target))·scale over the chunk, f32 in
//           place over the logits or bf16 into its own buffer (the products'
//           operand), zero on rows whose target is the ignore_index.
// The exponentials take exp(max(z, kExpMin)) as the CPU op, so no result is
// subnormal. Max and sums go through block_max and block_sum, so the host
// runs give the device's bits.
#pragma once
#include <cstdint>

#include "anvil/ops/cuda/kernel_body.h"

namespace anvil::kernel {

constexpr unsigned kCrossEntropyThreads = 256;
constexpr unsigned kCrossEntropyMaxBlocks = 65535;
// The CPU op's floor on exp's argument (ops/cross_entropy.cpp).
constexpr float kCrossEntropyExpMin = -86.0f;

// Pass 1 and the dlogits: one block per row of the chunk (grid-stride past
// the cap); dlogits: blockIdx.y over the rows, x over the chunk's columns.
inline LaunchShape cross_entropy_rows_launch_shape(int64_t rows) {
  return {{blocks_for(rows, 1, kCrossEntropyMaxBlocks), 1}, {kCrossEntropyThreads, 1}};
}
inline LaunchShape cross_entropy_dlogits_launch_shape(int64_t rows, int64_t chunk) {
  const int64_t y = rows < 1 ? 1 : rows < 65535 ? rows : 65535;
  return {{blocks_for(chunk, kCrossEntropyThreads), static_cast<unsigned>(y)}, {kCrossEntropyThreads, 1}};
}
// The loss: one block over every row, so its sum has one fixed order.
inline LaunchShape cross_entropy_loss_launch_shape() { return {{1, 1}, {kCrossEntropyThreads, 1}}; }

ANVIL_HD inline float cross_entropy_exp(float z) { return exp_f32(max_f32(z, kCrossEntropyExpMin)); }

// Pass 1 over one chunk: logits (Bn, Cn) of vocabulary entries [v0, v0 + Cn);
// targets, row_max, row_sum, row_target (Bn) of the block's rows. The first
// chunk (first_chunk) starts each row from max −∞ and Σ 0 and sets its target
// logit to 0; an ignored row is then −∞, 0, 0 (the CPU shard stats'), and
// later chunks leave it.
template <class Block>
ANVIL_HD void cross_entropy_lse_update_program(Block& block, const float* logits, int64_t Bn, int64_t Cn, int64_t v0,
                                               const int32_t* targets, int32_t ignore_index, bool first_chunk,
                                               float* row_max, float* row_sum, float* row_target) {
  for (int64_t i = block.index(); i < Bn; i += block.count()) {
    const int32_t target = targets[i];
    if (target == ignore_index) {
      if (first_chunk)
        block.each([&](const ThreadPos& p) {
          if (p.thread_in_block() == 0) row_max[i] = -INFINITY, row_sum[i] = 0.0f, row_target[i] = 0.0f;
        });
      continue;
    }
    const float* l = logits + i * Cn;
    const float chunk_max = block.max([&](const ThreadPos& p) {
      float m = -INFINITY;
      for (int64_t j = p.thread_in_block(); j < Cn; j += p.threads_per_block()) m = max_f32(m, l[j]);
      return m;
    });
    const float old_max = first_chunk ? -INFINITY : row_max[i];
    const float old_sum = first_chunk ? 0.0f : row_sum[i];
    const float m = max_f32(old_max, chunk_max);
    const float chunk_sum = block.template sum<float>([&](const ThreadPos& p) {
      float acc = 0;
      for (int64_t j = p.thread_in_block(); j < Cn; j += p.threads_per_block()) acc = acc + cross_entropy_exp(l[j] - m);
      return acc;
    });
    block.each([&](const ThreadPos& p) {
      if (p.thread_in_block() != 0) return;
      // The running sum rescaled to the new max; exp(−∞) = 0 on the first chunk.
      row_sum[i] = fma_rn(old_sum, exp_f32(old_max - m), chunk_sum);
      row_max[i] = m;
      if (first_chunk) row_target[i] = 0.0f;
      if (target >= v0 && target < v0 + Cn) row_target[i] = l[target - v0];
    });
  }
}

// After the last chunk, over M rows: lse[i] = row_max + log(row_sum) in f32
// (0 for an ignored row), and *loss_sum = Σ (lse − target logit) in double,
// *num_tokens the rows counted. One block: each thread's rows in order, then
// block_sum.
template <class Block>
ANVIL_HD void cross_entropy_loss_program(Block& block, const float* row_max, const float* row_sum,
                                         const float* row_target, const int32_t* targets, int32_t ignore_index,
                                         int64_t M, float* lse, double* loss_sum, int64_t* num_tokens) {
  const double loss = block.template sum<double>([&](const ThreadPos& p) {
    double acc = 0;
    for (int64_t i = p.thread_in_block(); i < M; i += p.threads_per_block()) {
      if (targets[i] == ignore_index) {
        lse[i] = 0.0f;
        continue;
      }
      lse[i] = row_max[i] + log_f32(row_sum[i]);
      acc += static_cast<double>(lse[i]) - static_cast<double>(row_target[i]);
    }
    return acc;
  });
  const int64_t tokens = block.template sum<int64_t>([&](const ThreadPos& p) {
    int64_t n = 0;
    for (int64_t i = p.thread_in_block(); i < M; i += p.threads_per_block()) n += targets[i] != ignore_index;
    return n;
  });
  block.each([&](const ThreadPos& p) {
    if (p.thread_in_block() == 0) *loss_sum = loss, *num_tokens = tokens;
  });
}

// Pass 2 over one chunk: dlogits[i, j] = (exp(logit − lse_i) − [v0 + j ==
// target_i])·scale, the CPU op's dlogits_row (the target's term unfloored).
// dlogits may be the logits (f32, in place: each element is read, then
// written, by one thread).
template <class T>
ANVIL_HD void cross_entropy_dlogits_body(const ThreadPos& pos, const float* logits, T* dlogits, int64_t Bn, int64_t Cn,
                                         int64_t v0, const int32_t* targets, int32_t ignore_index, const float* lse,
                                         float scale) {
  for (int64_t i = pos.block.y; i < Bn; i += pos.grid_dim.y) {
    const int32_t target = targets[i];
    for (int64_t j = pos.global_x(); j < Cn; j += pos.grid_stride_x()) {
      const int64_t at = i * Cn + j;
      float g = 0.0f;
      if (target != ignore_index) {
        const float z = logits[at] - lse[i];
        g = v0 + j == target ? mul_rn(exp_f32(z) - 1.0f, scale) : mul_rn(cross_entropy_exp(z), scale);
      }
      store_f32(dlogits, at, g);
    }
  }
}

}  // namespace anvil::kernel
