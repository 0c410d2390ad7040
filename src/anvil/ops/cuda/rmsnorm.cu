#include "anvil/core/error.h"
#include "anvil/ops/cuda/launch_check.h"
#include "anvil/ops/cuda/rmsnorm.h"
#include "anvil/ops/cuda/rmsnorm_body.h"

namespace anvil {

namespace {

// No __restrict__ on the rows: y may be x, dx may be dy.
template <class T>
__global__ void rmsnorm_forward_kernel(const T* x, const T* __restrict__ w, float eps, T* y, float* __restrict__ rstd,
                                       int64_t M, int64_t D) {
  kernel::DeviceBlock block;
  kernel::rmsnorm_forward_program(block, x, w, eps, y, rstd, M, D);
}

template <class T>
__global__ void rmsnorm_backward_kernel(const T* dy, const T* __restrict__ x, const T* __restrict__ w,
                                        const float* __restrict__ rstd, T* dx, float* __restrict__ dw_partials,
                                        int64_t M, int64_t D, bool accumulate_dx) {
  kernel::DeviceBlock block;
  kernel::rmsnorm_backward_program(block, dy, x, w, rstd, dx, dw_partials, M, D, accumulate_dx);
}

template <class G>
__global__ void rmsnorm_dw_kernel(const float* __restrict__ dw_partials, int64_t splits, int64_t D,
                                  G* __restrict__ dw) {
  kernel::rmsnorm_dw_body(kernel::this_thread(), dw_partials, splits, D, dw);
}

}  // namespace

template <class T>
void rmsnorm_forward_cuda(const T* x, const T* w, float eps, T* y, float* rstd, int64_t M, int64_t D,
                          cudaStream_t stream) {
  if (M <= 0 || D <= 0) return;
  const kernel::LaunchShape s = kernel::rmsnorm_forward_launch_shape(M);
  rmsnorm_forward_kernel<<<s.grid.x, s.block.x, 0, stream>>>(x, w, eps, y, rstd, M, D);
  check_launch("rmsnorm_forward_cuda");
}

int64_t rmsnorm_backward_scratch(int64_t M, int64_t D) { return kernel::rmsnorm_dw_splits(M) * D; }

template <class T, class G>
void rmsnorm_backward_cuda(const T* dy, const T* x, const T* w, const float* rstd, T* dx, G* dw, float* scratch,
                           int64_t M, int64_t D, bool accumulate_dx, cudaStream_t stream) {
  if (M <= 0 || D <= 0) return;
  ANVIL_CHECK(rstd != nullptr, "rmsnorm_backward_cuda: rstd from the forward is required");
  const kernel::LaunchShape s = kernel::rmsnorm_backward_launch_shape(M);
  rmsnorm_backward_kernel<<<s.grid.x, s.block.x, 0, stream>>>(dy, x, w, rstd, dx, scratch, M, D, accumulate_dx);
  check_launch("rmsnorm_backward_cuda");
  const kernel::LaunchShape r = kernel::rmsnorm_dw_launch_shape(D);
  rmsnorm_dw_kernel<<<r.grid.x, r.block.x, 0, stream>>>(scratch, kernel::rmsnorm_dw_splits(M), D, dw);
  check_launch("rmsnorm_backward_cuda");
}

template void rmsnorm_forward_cuda<float>(const float*, const float*, float, float*, float*, int64_t, int64_t,
                                          cudaStream_t);
template void rmsnorm_forward_cuda<uint16_t>(const uint16_t*, const uint16_t*, float, uint16_t*, float*, int64_t,
                                             int64_t, cudaStream_t);
#define ANVIL_RMSNORM_BACKWARD(T, G)                                                                          \
  template void rmsnorm_backward_cuda<T, G>(const T*, const T*, const T*, const float*, T*, G*, float*, int64_t, \
                                            int64_t, bool, cudaStream_t);
ANVIL_RMSNORM_BACKWARD(float, float)
ANVIL_RMSNORM_BACKWARD(float, uint16_t)
ANVIL_RMSNORM_BACKWARD(uint16_t, float)
ANVIL_RMSNORM_BACKWARD(uint16_t, uint16_t)
#undef ANVIL_RMSNORM_BACKWARD

}  // namespace anvil
