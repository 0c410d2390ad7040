#include "anvil/ops/cuda/embedding.h"
#include "anvil/ops/cuda/embedding_body.h"
#include "anvil/ops/cuda/launch_check.h"

namespace anvil {

namespace {

template <class S, class Dst>
__global__ void embedding_forward_kernel(const int32_t* __restrict__ tokens, int64_t M, const S* __restrict__ table,
                                         int64_t V, int64_t D, Dst* __restrict__ out) {
  kernel::embedding_forward_body(kernel::this_thread(), tokens, M, table, V, D, out);
}

template <class S, class G>
__global__ void embedding_backward_kernel(const S* __restrict__ dout, const int32_t* __restrict__ tokens, int64_t M,
                                          int64_t V, int64_t D, G* __restrict__ dtable) {
  kernel::embedding_backward_body(kernel::this_thread(), dout, tokens, M, V, D, dtable);
}

}  // namespace

template <class Table, class Out>
void embedding_forward_cuda(const int32_t* tokens, int64_t M, const Table* table, int64_t V, int64_t D, Out* out,
                            cudaStream_t stream) {
  if (M <= 0 || D <= 0) return;
  const kernel::LaunchShape s = kernel::embedding_forward_launch_shape(M, D);
  embedding_forward_kernel<<<dim3(s.grid.x, s.grid.y), s.block.x, 0, stream>>>(tokens, M, table, V, D, out);
  check_launch("embedding_forward_cuda");
}

template <class Dout, class Grad>
void embedding_backward_cuda(const Dout* dout, const int32_t* tokens, int64_t M, int64_t V, int64_t D, Grad* dtable,
                             cudaStream_t stream) {
  if (M <= 0 || D <= 0) return;
  const kernel::LaunchShape s = kernel::embedding_backward_launch_shape(D);
  embedding_backward_kernel<<<s.grid.x, s.block.x, 0, stream>>>(dout, tokens, M, V, D, dtable);
  check_launch("embedding_backward_cuda");
}

#define ANVIL_EMBEDDING_INSTANCES(A, B)                                                                            \
  template void embedding_forward_cuda<A, B>(const int32_t*, int64_t, const A*, int64_t, int64_t, B*, cudaStream_t); \
  template void embedding_backward_cuda<A, B>(const A*, const int32_t*, int64_t, int64_t, int64_t, B*, cudaStream_t);
ANVIL_EMBEDDING_INSTANCES(float, float)
ANVIL_EMBEDDING_INSTANCES(float, uint16_t)
ANVIL_EMBEDDING_INSTANCES(uint16_t, float)
ANVIL_EMBEDDING_INSTANCES(uint16_t, uint16_t)
#undef ANVIL_EMBEDDING_INSTANCES

}  // namespace anvil
