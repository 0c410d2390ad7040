#include "anvil/ops/cuda/attention_softmax.h"
#include "anvil/ops/cuda/attention_softmax_body.h"
#include "anvil/ops/cuda/launch_check.h"

namespace anvil {

namespace {

// No __restrict__ on the rows written: they may be the rows read (in place).
__global__ void softmax_forward_kernel(const float* scores, float* probs, float* __restrict__ lse, int64_t rows,
                                       int64_t T, float scale, const int32_t* __restrict__ first_key) {
  kernel::DeviceBlock block;
  kernel::attention_softmax_forward_program(block, scores, probs, lse, rows, T, scale, first_key);
}

__global__ void softmax_backward_kernel(const float* __restrict__ probs, const float* dprobs, float* dscores,
                                        int64_t rows, int64_t T, float scale, const int32_t* __restrict__ first_key) {
  kernel::DeviceBlock block;
  kernel::attention_softmax_backward_program(block, probs, dprobs, dscores, rows, T, scale, first_key);
}

}  // namespace

void attention_softmax_forward_cuda(const float* scores, float* probs, float* lse, int64_t rows, int64_t T,
                                    float scale, const int32_t* first_key, cudaStream_t stream) {
  if (rows <= 0 || T <= 0) return;
  const kernel::LaunchShape s = kernel::attention_softmax_launch_shape(rows);
  softmax_forward_kernel<<<s.grid.x, s.block.x, 0, stream>>>(scores, probs, lse, rows, T, scale, first_key);
  check_launch("attention_softmax_forward_cuda");
}

void attention_softmax_backward_cuda(const float* probs, const float* dprobs, float* dscores, int64_t rows, int64_t T,
                                     float scale, const int32_t* first_key, cudaStream_t stream) {
  if (rows <= 0 || T <= 0) return;
  const kernel::LaunchShape s = kernel::attention_softmax_launch_shape(rows);
  softmax_backward_kernel<<<s.grid.x, s.block.x, 0, stream>>>(probs, dprobs, dscores, rows, T, scale, first_key);
  check_launch("attention_softmax_backward_cuda");
}

}  // namespace anvil
