#include <cuda_bf16.h>

#include "anvil/core/error.h"
#include "anvil/ops/cuda/cast.h"

namespace anvil {

namespace {

// A grid-stride loop: any n with a grid sized for the GPU, not for n.
__global__ void cast_f32_to_bf16_kernel(const float* __restrict__ in, uint16_t* __restrict__ out, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    out[i] = __bfloat16_as_ushort(__float2bfloat16_rn(in[i]));
}

}  // namespace

void cast_f32_to_bf16_cuda(const float* in, uint16_t* out, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  constexpr int kThreads = 256;
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  const int grid = static_cast<int>(blocks < 65536 ? blocks : 65536);
  cast_f32_to_bf16_kernel<<<grid, kThreads, 0, stream>>>(in, out, n);
  const cudaError_t err = cudaGetLastError();
  ANVIL_CHECK(err == cudaSuccess, "cast_f32_to_bf16_cuda: launch failed: ", cudaGetErrorString(err));
}

}  // namespace anvil
