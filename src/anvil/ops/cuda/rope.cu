#include "anvil/core/error.h"
#include "anvil/ops/cuda/launch_check.h"
#include "anvil/ops/cuda/rope.h"
#include "anvil/ops/cuda/rope_body.h"

namespace anvil {

namespace {

// No __restrict__ on x and y: the rotation may be in place.
template <bool kInverse, class T>
__global__ void rope_kernel(const T* x, const float* __restrict__ cos_table, const float* __restrict__ sin_table,
                            int64_t tokens, int64_t T_, int64_t H, int64_t D, int64_t pos_offset, T* y) {
  kernel::rope_body<kInverse>(kernel::this_thread(), x, cos_table, sin_table, tokens, T_, H, D, pos_offset, y);
}

template <bool kInverse, class T>
void rope_apply(const T* x, const float* cos_table, const float* sin_table, int64_t max_positions, int64_t B,
                int64_t T_, int64_t H, int64_t D, int64_t pos_offset, T* y, cudaStream_t stream, const char* what) {
  ANVIL_CHECK(D % 2 == 0, what, ": head_dim ", D, " must be even (RoPE rotates pairs)");
  ANVIL_CHECK(pos_offset >= 0 && pos_offset + T_ <= max_positions, what, ": positions [", pos_offset, ", ",
              pos_offset + T_, ") are outside the RoPE table, which covers [0, ", max_positions, ")");
  if (B <= 0 || T_ <= 0 || H <= 0 || D <= 0) return;
  const kernel::LaunchShape s = kernel::rope_launch_shape(B * T_, H * D / 2);
  rope_kernel<kInverse><<<dim3(s.grid.x, s.grid.y), s.block.x, 0, stream>>>(x, cos_table, sin_table, B * T_, T_, H, D,
                                                                           pos_offset, y);
  check_launch(what);
}

}  // namespace

template <class T>
void rope_forward_cuda(const T* x, const float* cos_table, const float* sin_table, int64_t max_positions, int64_t B,
                       int64_t T_, int64_t H, int64_t D, int64_t pos_offset, T* y, cudaStream_t stream) {
  rope_apply<false>(x, cos_table, sin_table, max_positions, B, T_, H, D, pos_offset, y, stream, "rope_forward_cuda");
}

template <class T>
void rope_backward_cuda(const T* dy, const float* cos_table, const float* sin_table, int64_t max_positions, int64_t B,
                        int64_t T_, int64_t H, int64_t D, int64_t pos_offset, T* dx, cudaStream_t stream) {
  rope_apply<true>(dy, cos_table, sin_table, max_positions, B, T_, H, D, pos_offset, dx, stream, "rope_backward_cuda");
}

#define ANVIL_ROPE_INSTANCES(T)                                                                                  \
  template void rope_forward_cuda<T>(const T*, const float*, const float*, int64_t, int64_t, int64_t, int64_t,  \
                                     int64_t, int64_t, T*, cudaStream_t);                                        \
  template void rope_backward_cuda<T>(const T*, const float*, const float*, int64_t, int64_t, int64_t, int64_t, \
                                      int64_t, int64_t, T*, cudaStream_t);
ANVIL_ROPE_INSTANCES(float)
ANVIL_ROPE_INSTANCES(uint16_t)
#undef ANVIL_ROPE_INSTANCES

}  // namespace anvil
