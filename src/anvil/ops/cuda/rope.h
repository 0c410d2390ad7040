// RoPE on the GPU, the CUDA twins of ops/rope.h's rope_forward and
// rope_backward over device pointers: x, y (B, T, H, D), f32 (float) or bf16
// (uint16_t bits); cos_table, sin_table (max_positions, D/2) f32, the CPU op's
// RopeTable uploaded. Token t sits at position pos_offset + t, which must be
// below max_positions (checked here: the table's size is a host value). y may
// be x. Launch on `stream` and return at once; a bad argument or a failed
// launch throws anvil::Error.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace anvil {

template <class T>
void rope_forward_cuda(const T* x, const float* cos_table, const float* sin_table, int64_t max_positions, int64_t B,
                       int64_t T_, int64_t H, int64_t D, int64_t pos_offset, T* y, cudaStream_t stream);

// The inverse rotation: dy -> dx (dx may be dy).
template <class T>
void rope_backward_cuda(const T* dy, const float* cos_table, const float* sin_table, int64_t max_positions, int64_t B,
                        int64_t T_, int64_t H, int64_t D, int64_t pos_offset, T* dx, cudaStream_t stream);

}  // namespace anvil
