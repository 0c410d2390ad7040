// RoPE's per-pair body (kernel_body.h), the CUDA twin of ops/rope.h: the
// HALVES convention (element i of a head pairs with i + D/2) and the CPU op's
// table, cos/sin (max_positions, D/2) f32, indexed by pos_offset + t.
//
// Each pair is rotated with the CPU op's roundings: one product rounded, the
// other fused,
//   forward  y1 = fma(x1, cos, −(x2·sin)),  y2 = fma(x2, cos, x1·sin)
//   inverse  y1 = fma(x1, cos, x2·sin),     y2 = fma(x2, cos, −(x1·sin))
// written with fma_rn/mul_rn, so neither compiler picks another contraction.
#pragma once
#include <cstdint>

#include "anvil/ops/cuda/kernel_body.h"

namespace anvil::kernel {

constexpr unsigned kRopeThreads = 128;

// blockIdx.y over the B·T tokens, x over the token's H·D/2 pairs.
inline LaunchShape rope_launch_shape(int64_t tokens, int64_t pairs_per_token) {
  const int64_t rows = tokens < 1 ? 1 : tokens < 65535 ? tokens : 65535;
  return {{blocks_for(pairs_per_token, kRopeThreads), static_cast<unsigned>(rows)}, {kRopeThreads, 1}};
}

// x, y (B, T, H, D) with tokens = B·T; y may be x.
template <bool kInverse, class T>
ANVIL_HD void rope_body(const ThreadPos& pos, const T* x, const float* cos_table, const float* sin_table, int64_t tokens,
                        int64_t T_, int64_t H, int64_t D, int64_t pos_offset, T* y) {
  const int64_t half = D / 2, pairs = H * half;
  for (int64_t bt = pos.block.y; bt < tokens; bt += pos.grid_dim.y) {
    const int64_t p = pos_offset + bt % T_;
    for (int64_t k = pos.global_x(); k < pairs; k += pos.grid_stride_x()) {
      const int64_t head = k / half, i = k % half;
      const int64_t at = bt * H * D + head * D + i;
      const float c = cos_table[p * half + i], s = sin_table[p * half + i];
      const float x1 = load_f32(x, at), x2 = load_f32(x, at + half);
      const float y1 = kInverse ? fma_rn(x1, c, mul_rn(x2, s)) : fma_rn(x1, c, -mul_rn(x2, s));
      const float y2 = kInverse ? fma_rn(x2, c, -mul_rn(x1, s)) : fma_rn(x2, c, mul_rn(x1, s));
      store_f32(y, at, y1);
      store_f32(y, at + half, y2);
    }
  }
}

}  // namespace anvil::kernel
