// The lse between Anvil's (B, H, T) and the token-major (B, T, H) statistics
// of cuDNN's ragged SDPA (lse_layout_body.h), on the GPU: device pointers,
// f32. Launch on `stream` and return at once; a launch error throws
// anvil::Error.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace anvil {

void lse_transpose_cuda(const float* src, float* dst, int64_t B, int64_t H, int64_t T, bool to_token_major,
                        cudaStream_t stream);

}  // namespace anvil
