// AdamW on the GPU over flat buffers, the CUDA twin of ops/adamw.h's
// adamw_step: the same update, bit for bit (adamw_body.h).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "anvil/ops/adamw.h"

namespace anvil {

// One AdamW step over n elements; p, g, m, v (f32) and p_bf16 (bf16 bits, or
// null to skip the compute copy) are device pointers, as adamw_step's tensors.
// Throws anvil::Error for step < 1, a non-finite grad_scale or a failed launch;
// the hyper-parameters are the caller's to check (check_adamw_config, once).
// Launches on `stream` and returns at once.
void adamw_step_cuda(const AdamWConfig& cfg, int64_t step, float* p, const float* g, float* m, float* v,
                     uint16_t* p_bf16, int64_t n, float grad_scale, cudaStream_t stream);

}  // namespace anvil
