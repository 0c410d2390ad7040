// The gradient norm's bodies (kernel_body.h), the CUDA twins of ops/grad_norm.h.
//
// Σ x² in two phased kernels: every block sums its grid-stride share of the
// squares into one partial, then a single block sums the partials. The sums
// are in double, as the CPU op's; a square of an f32 is exact in double (24-bit
// significands), so whether a compiler fuses acc + x·x into an FMA changes no
// bit, and only the additions round, in block_sum's fixed order: the result is
// the same on every run, on the host and on the device.
#pragma once
#include <cstdint>

#include "anvil/ops/cuda/kernel_body.h"

namespace anvil::kernel {

constexpr unsigned kGradNormThreads = 256;
// At most this many blocks (and per-block partials): enough to fill a GPU, few
// enough for the second kernel's single block to sum quickly.
constexpr unsigned kGradNormMaxBlocks = 1024;

inline LaunchShape sum_squares_launch_shape(int64_t n) {
  return {{blocks_for(n, kGradNormThreads, kGradNormMaxBlocks), 1}, {kGradNormThreads, 1}};
}
inline LaunchShape sum_partials_launch_shape() { return {{1, 1}, {kGradNormThreads, 1}}; }
inline LaunchShape scale_launch_shape(int64_t n) { return {{blocks_for(n, kGradNormThreads), 1}, {kGradNormThreads, 1}}; }

// Phase 1 of the first kernel: this thread's Σ x² over its grid-stride share.
template <class T>
ANVIL_HD double sum_squares_partial(const ThreadPos& pos, const T* x, int64_t n) {
  double acc = 0;
  for (int64_t i = pos.global_x(); i < n; i += pos.grid_stride_x()) {
    const double xi = load_f32(x, i);
    acc += xi * xi;
  }
  return acc;
}

// Phase 1 of the second kernel: this thread's share of the blocks' partials.
ANVIL_HD inline double sum_partials_partial(const ThreadPos& pos, const double* partials, int64_t count) {
  double acc = 0;
  for (int64_t i = pos.global_x(); i < count; i += pos.grid_stride_x()) acc += partials[i];
  return acc;
}

// Phase 2 of both: the block's total goes to out[blockIdx.x].
ANVIL_HD inline void write_block_total(const ThreadPos& pos, double total, double* out) {
  if (pos.thread_in_block() == 0) out[pos.block.x] = total;
}

// x ← x·scale (grid-stride), bf16 rounded to nearest even, as scale_grads_.
template <class T>
ANVIL_HD void scale_body(const ThreadPos& pos, T* x, int64_t n, float scale) {
  for (int64_t i = pos.global_x(); i < n; i += pos.grid_stride_x()) store_f32(x, i, mul_rn(load_f32(x, i), scale));
}

}  // namespace anvil::kernel
