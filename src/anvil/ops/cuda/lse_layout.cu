#include "anvil/ops/cuda/launch_check.h"
#include "anvil/ops/cuda/lse_layout.h"
#include "anvil/ops/cuda/lse_layout_body.h"

namespace anvil {

namespace {

__global__ void lse_transpose_kernel(const float* __restrict__ src, float* __restrict__ dst, int64_t B, int64_t H,
                                     int64_t T, bool to_token_major) {
  kernel::lse_transpose_body(kernel::this_thread(), src, dst, B, H, T, to_token_major);
}

}  // namespace

void lse_transpose_cuda(const float* src, float* dst, int64_t B, int64_t H, int64_t T, bool to_token_major,
                        cudaStream_t stream) {
  const int64_t n = B * H * T;
  if (n <= 0) return;
  const kernel::LaunchShape s = kernel::lse_transpose_launch_shape(n);
  lse_transpose_kernel<<<s.grid.x, s.block.x, 0, stream>>>(src, dst, B, H, T, to_token_major);
  check_launch("lse_transpose_cuda");
}

}  // namespace anvil
