#include "anvil/ops/cuda/cast.h"
#include "anvil/ops/cuda/cast_body.h"
#include "anvil/ops/cuda/launch_check.h"

namespace anvil {

namespace {

__global__ void cast_f32_to_bf16_kernel(const float* __restrict__ in, uint16_t* __restrict__ out, int64_t n) {
  kernel::cast_f32_to_bf16_body(kernel::this_thread(), in, out, n);
}

__global__ void cast_bf16_to_f32_kernel(const uint16_t* __restrict__ in, float* __restrict__ out, int64_t n) {
  kernel::cast_bf16_to_f32_body(kernel::this_thread(), in, out, n);
}

}  // namespace

void cast_f32_to_bf16_cuda(const float* in, uint16_t* out, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  const kernel::LaunchShape s = kernel::cast_launch_shape(n);
  cast_f32_to_bf16_kernel<<<s.grid.x, s.block.x, 0, stream>>>(in, out, n);
  check_launch("cast_f32_to_bf16_cuda");
}

void cast_bf16_to_f32_cuda(const uint16_t* in, float* out, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  const kernel::LaunchShape s = kernel::cast_launch_shape(n);
  cast_bf16_to_f32_kernel<<<s.grid.x, s.block.x, 0, stream>>>(in, out, n);
  check_launch("cast_bf16_to_f32_cuda");
}

}  // namespace anvil
