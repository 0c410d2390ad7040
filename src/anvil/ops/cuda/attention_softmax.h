// The fp32 attention's causal row softmax on the GPU (attention_softmax_body.h),
// between the cuBLASLt products of a parity run: device pointers, f32, rows =
// B·H·T rows of T scores, row r being query r mod T. Launch on `stream` and
// return at once; a launch error throws anvil::Error.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace anvil {

// probs = causal softmax(scale·scores) per row (0 past the query), lse =
// log Σ_{j≤t} exp(scale·scores_j) (natural log, ops/attention.h's). probs
// may be scores.
void attention_softmax_forward_cuda(const float* scores, float* probs, float* lse, int64_t rows, int64_t T,
                                    float scale, cudaStream_t stream);

// dscores = scale·probs ⊙ (dprobs − rowsum(dprobs ⊙ probs)), 0 past the query:
// the gradient of the raw scores. dscores may be dprobs.
void attention_softmax_backward_cuda(const float* probs, const float* dprobs, float* dscores, int64_t rows, int64_t T,
                                     float scale, cudaStream_t stream);

}  // namespace anvil
