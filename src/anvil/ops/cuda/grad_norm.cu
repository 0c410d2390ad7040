#include "anvil/ops/cuda/grad_norm.h"
#include "anvil/ops/cuda/grad_norm_body.h"
#include "anvil/ops/cuda/launch_check.h"

namespace anvil {

namespace {

using kernel::ThreadPos;

template <class T>
__global__ void sum_squares_kernel(const T* __restrict__ x, int64_t n, double* __restrict__ partials) {
  kernel::block_reduction<double>([&](const ThreadPos& pos) { return kernel::sum_squares_partial(pos, x, n); },
                                  [&](const ThreadPos& pos, double total) { kernel::write_block_total(pos, total, partials); });
}

__global__ void sum_partials_kernel(const double* __restrict__ partials, int64_t count, double* __restrict__ out) {
  kernel::block_reduction<double>([&](const ThreadPos& pos) { return kernel::sum_partials_partial(pos, partials, count); },
                                  [&](const ThreadPos& pos, double total) { kernel::write_block_total(pos, total, out); });
}

template <class T>
__global__ void scale_kernel(T* __restrict__ x, int64_t n, float scale) {
  kernel::scale_body(kernel::this_thread(), x, n, scale);
}

template <class T>
void sum_squares(const T* x, int64_t n, double* workspace, double* out, cudaStream_t stream) {
  const kernel::LaunchShape s = kernel::sum_squares_launch_shape(n);
  sum_squares_kernel<<<s.grid.x, s.block.x, 0, stream>>>(x, n, workspace);
  check_launch("grad_sum_of_squares_cuda");
  const kernel::LaunchShape f = kernel::sum_partials_launch_shape();
  sum_partials_kernel<<<f.grid.x, f.block.x, 0, stream>>>(workspace, s.grid.x, out);
  check_launch("grad_sum_of_squares_cuda");
}

template <class T>
void scale(T* x, int64_t n, float s, cudaStream_t stream) {
  if (n <= 0) return;
  const kernel::LaunchShape shape = kernel::scale_launch_shape(n);
  scale_kernel<<<shape.grid.x, shape.block.x, 0, stream>>>(x, n, s);
  check_launch("scale_grads_cuda");
}

}  // namespace

int64_t grad_sum_of_squares_workspace() { return kernel::kGradNormMaxBlocks; }

void grad_sum_of_squares_cuda(const float* x, int64_t n, double* workspace, double* out, cudaStream_t stream) {
  sum_squares(x, n, workspace, out, stream);
}
void grad_sum_of_squares_cuda(const uint16_t* x, int64_t n, double* workspace, double* out, cudaStream_t stream) {
  sum_squares(x, n, workspace, out, stream);
}
void scale_grads_cuda(float* x, int64_t n, float s, cudaStream_t stream) { scale(x, n, s, stream); }
void scale_grads_cuda(uint16_t* x, int64_t n, float s, cudaStream_t stream) { scale(x, n, s, stream); }

}  // namespace anvil
