// Casts on the GPU, the CUDA twins of the CPU's bf16 conversions (core/dtype.h).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace anvil {

// out[i] = bf16 bits of in[i], rounded to nearest even as bf16::from_float
// does, NaN payloads included; `in` and `out` are device pointers. Launches on
// `stream` and returns at once; a launch error throws anvil::Error.
void cast_f32_to_bf16_cuda(const float* in, uint16_t* out, int64_t n, cudaStream_t stream);

// out[i] = the f32 value of the bf16 bits in[i] (exact), as bf16::to_float.
void cast_bf16_to_f32_cuda(const uint16_t* in, float* out, int64_t n, cudaStream_t stream);

}  // namespace anvil
