#include "anvil/ops/cuda/launch_check.h"
#include "anvil/ops/cuda/swiglu.h"
#include "anvil/ops/cuda/swiglu_body.h"

namespace anvil {

namespace {

// No __restrict__: the outputs may be the inputs (in-place use).
template <class T>
__global__ void swiglu_forward_kernel(const T* g, const T* u, T* h, int64_t n) {
  kernel::swiglu_forward_body(kernel::this_thread(), g, u, h, n);
}

template <class T>
__global__ void swiglu_backward_kernel(const T* dh, const T* g, const T* u, T* dg, T* du, int64_t n) {
  kernel::swiglu_backward_body(kernel::this_thread(), dh, g, u, dg, du, n);
}

}  // namespace

template <class T>
void swiglu_forward_cuda(const T* g, const T* u, T* h, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  const kernel::LaunchShape s = kernel::swiglu_launch_shape(n);
  swiglu_forward_kernel<<<s.grid.x, s.block.x, 0, stream>>>(g, u, h, n);
  check_launch("swiglu_forward_cuda");
}

template <class T>
void swiglu_backward_cuda(const T* dh, const T* g, const T* u, T* dg, T* du, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  const kernel::LaunchShape s = kernel::swiglu_launch_shape(n);
  swiglu_backward_kernel<<<s.grid.x, s.block.x, 0, stream>>>(dh, g, u, dg, du, n);
  check_launch("swiglu_backward_cuda");
}

template void swiglu_forward_cuda<float>(const float*, const float*, float*, int64_t, cudaStream_t);
template void swiglu_forward_cuda<uint16_t>(const uint16_t*, const uint16_t*, uint16_t*, int64_t, cudaStream_t);
template void swiglu_backward_cuda<float>(const float*, const float*, const float*, float*, float*, int64_t,
                                          cudaStream_t);
template void swiglu_backward_cuda<uint16_t>(const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*, uint16_t*,
                                             int64_t, cudaStream_t);

}  // namespace anvil
