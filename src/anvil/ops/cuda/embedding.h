// The token embedding on the GPU, the CUDA twins of ops/embedding.h over
// device pointers. Storage is f32 (float) or bf16 (uint16_t bits), in any of
// the CPU op's combinations: the four instantiations of each are built.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace anvil {

// out (M, D) = rows tokens[m] of table (V, D), each element copied or
// converted once (rounding to nearest even into bf16). The ids must be in
// [0, V): check them on the host before the upload, as embedding_forward
// does; an id outside gives a zero row here (the kernel cannot throw).
// Launches on `stream` and returns at once; a launch error throws anvil::Error.
template <class Table, class Out>
void embedding_forward_cuda(const int32_t* tokens, int64_t M, const Table* table, int64_t V, int64_t D, Out* out,
                            cudaStream_t stream);

// dtable (V, D) += dout (M, D) scattered by tokens: ACCUMULATED, repeated ids
// adding up in token order, bit for bit as embedding_backward. An id outside
// [0, V) adds nothing.
template <class Dout, class Grad>
void embedding_backward_cuda(const Dout* dout, const int32_t* tokens, int64_t M, int64_t V, int64_t D, Grad* dtable,
                             cudaStream_t stream);

}  // namespace anvil
