// The lse's two layouts (kernel_body.h): Anvil's (B, H, T), as
// ops/attention.h's attention writes and reads it, and the token-major
// (B, T, H) statistics cuDNN's ragged SDPA takes (ops/sdpa_layout.h). A
// grid-stride loop over the destination's elements, each one copy, so the
// transpose is exact and its two directions are inverses.
#pragma once
#include <cstdint>

#include "anvil/ops/cuda/kernel_body.h"

namespace anvil::kernel {

constexpr unsigned kLseTransposeThreads = 256;

inline LaunchShape lse_transpose_launch_shape(int64_t n) {
  return {{blocks_for(n, kLseTransposeThreads), 1}, {kLseTransposeThreads, 1}};
}

// dst (B, T, H) from src (B, H, T) when to_token_major, else dst (B, H, T)
// from src (B, T, H). src and dst do not overlap.
ANVIL_HD inline void lse_transpose_body(const ThreadPos& pos, const float* src, float* dst, int64_t B, int64_t H,
                                        int64_t T, bool to_token_major) {
  const int64_t n = B * H * T;
  for (int64_t i = pos.global_x(); i < n; i += pos.grid_stride_x()) {
    const int64_t b = i / (H * T), rest = i % (H * T);
    if (to_token_major) {  // i = (b·T + t)·H + h
      const int64_t t = rest / H, h = rest % H;
      dst[i] = src[(b * H + h) * T + t];
    } else {  // i = (b·H + h)·T + t
      const int64_t h = rest / T, t = rest % T;
      dst[i] = src[(b * T + t) * H + h];
    }
  }
}

}  // namespace anvil::kernel
