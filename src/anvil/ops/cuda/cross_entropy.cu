#include "anvil/ops/cuda/cross_entropy.h"
#include "anvil/ops/cuda/cross_entropy_body.h"
#include "anvil/ops/cuda/launch_check.h"

namespace anvil {

namespace {

__global__ void lse_update_kernel(const float* __restrict__ logits, int64_t Bn, int64_t Cn, int64_t v0,
                                  const int32_t* __restrict__ targets, int32_t ignore_index, bool first_chunk,
                                  float* __restrict__ row_max, float* __restrict__ row_sum,
                                  float* __restrict__ row_target) {
  kernel::DeviceBlock block;
  kernel::cross_entropy_lse_update_program(block, logits, Bn, Cn, v0, targets, ignore_index, first_chunk, row_max,
                                           row_sum, row_target);
}

__global__ void loss_kernel(const float* __restrict__ row_max, const float* __restrict__ row_sum,
                            const float* __restrict__ row_target, const int32_t* __restrict__ targets,
                            int32_t ignore_index, int64_t M, float* __restrict__ lse, double* __restrict__ loss_sum,
                            int64_t* __restrict__ num_tokens) {
  kernel::DeviceBlock block;
  kernel::cross_entropy_loss_program(block, row_max, row_sum, row_target, targets, ignore_index, M, lse, loss_sum,
                                     num_tokens);
}

// No __restrict__ on logits and dlogits: f32 dlogits overwrite the logits.
template <class T>
__global__ void dlogits_kernel(const float* logits, T* dlogits, int64_t Bn, int64_t Cn, int64_t v0,
                               const int32_t* __restrict__ targets, int32_t ignore_index,
                               const float* __restrict__ lse, float scale) {
  kernel::cross_entropy_dlogits_body(kernel::this_thread(), logits, dlogits, Bn, Cn, v0, targets, ignore_index, lse,
                                     scale);
}

}  // namespace

void cross_entropy_lse_update_cuda(const float* logits, int64_t Bn, int64_t Cn, int64_t v0, const int32_t* targets,
                                   int32_t ignore_index, bool first_chunk, float* row_max, float* row_sum,
                                   float* row_target, cudaStream_t stream) {
  if (Bn <= 0 || Cn <= 0) return;
  const kernel::LaunchShape s = kernel::cross_entropy_rows_launch_shape(Bn);
  lse_update_kernel<<<s.grid.x, s.block.x, 0, stream>>>(logits, Bn, Cn, v0, targets, ignore_index, first_chunk,
                                                        row_max, row_sum, row_target);
  check_launch("cross_entropy_lse_update_cuda");
}

void cross_entropy_loss_cuda(const float* row_max, const float* row_sum, const float* row_target,
                             const int32_t* targets, int32_t ignore_index, int64_t M, float* lse, double* loss_sum,
                             int64_t* num_tokens, cudaStream_t stream) {
  const kernel::LaunchShape s = kernel::cross_entropy_loss_launch_shape();
  loss_kernel<<<s.grid.x, s.block.x, 0, stream>>>(row_max, row_sum, row_target, targets, ignore_index, M, lse,
                                                  loss_sum, num_tokens);
  check_launch("cross_entropy_loss_cuda");
}

template <class T>
void cross_entropy_dlogits_cuda(const float* logits, T* dlogits, int64_t Bn, int64_t Cn, int64_t v0,
                                const int32_t* targets, int32_t ignore_index, const float* lse, float scale,
                                cudaStream_t stream) {
  if (Bn <= 0 || Cn <= 0) return;
  const kernel::LaunchShape s = kernel::cross_entropy_dlogits_launch_shape(Bn, Cn);
  dlogits_kernel<<<dim3(s.grid.x, s.grid.y), s.block.x, 0, stream>>>(logits, dlogits, Bn, Cn, v0, targets,
                                                                      ignore_index, lse, scale);
  check_launch("cross_entropy_dlogits_cuda");
}

template void cross_entropy_dlogits_cuda<float>(const float*, float*, int64_t, int64_t, int64_t, const int32_t*,
                                                int32_t, const float*, float, cudaStream_t);
template void cross_entropy_dlogits_cuda<uint16_t>(const float*, uint16_t*, int64_t, int64_t, int64_t,
                                                   const int32_t*, int32_t, const float*, float, cudaStream_t);

}  // namespace anvil
