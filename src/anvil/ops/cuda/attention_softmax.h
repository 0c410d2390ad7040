// The fp32 attention's causal row softmax on the GPU (attention_softmax_body.h),
// between the cuBLASLt products of a parity run: device pointers, f32, rows =
// B·H·T rows of T scores, row r being query r mod T; under documents
// first_key (rows) i32 holds each row's first key, its document's start
// (null: 0). Launch on `stream` and
// return at once; a launch error throws anvil::Error.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace anvil {

// probs = causal softmax(scale·scores) per row over keys first..t (0
// elsewhere), lse = log Σ exp(scale·scores_j) over them (natural log,
// ops/attention.h's). probs may be scores.
void attention_softmax_forward_cuda(const float* scores, float* probs, float* lse, int64_t rows, int64_t T,
                                    float scale, const int32_t* first_key, cudaStream_t stream);

// dscores = scale·probs ⊙ (dprobs − rowsum(dprobs ⊙ probs)), 0 outside the
// row's keys: the gradient of the raw scores. dscores may be dprobs.
void attention_softmax_backward_cuda(const float* probs, const float* dprobs, float* dscores, int64_t rows, int64_t T,
                                     float scale, const int32_t* first_key, cudaStream_t stream);

}  // namespace anvil
