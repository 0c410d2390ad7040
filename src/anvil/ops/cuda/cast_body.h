// The casts' per-element bodies (kernel_body.h): grid-stride loops, so any n
// runs on a grid sized for the GPU rather than for n.
#pragma once
#include <cstdint>

#include "anvil/ops/cuda/kernel_body.h"

namespace anvil::kernel {

constexpr unsigned kCastThreads = 256;

inline LaunchShape cast_launch_shape(int64_t n) { return {{blocks_for(n, kCastThreads), 1}, {kCastThreads, 1}}; }

ANVIL_HD inline void cast_f32_to_bf16_body(const ThreadPos& pos, const float* in, uint16_t* out, int64_t n) {
  for (int64_t i = pos.global_x(); i < n; i += pos.grid_stride_x()) out[i] = bf16_from_f32(in[i]);
}

ANVIL_HD inline void cast_bf16_to_f32_body(const ThreadPos& pos, const uint16_t* in, float* out, int64_t n) {
  for (int64_t i = pos.global_x(); i < n; i += pos.grid_stride_x()) out[i] = f32_from_bf16(in[i]);
}

}  // namespace anvil::kernel
