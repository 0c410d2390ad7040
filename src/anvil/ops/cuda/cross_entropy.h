// The fused LM head + cross-entropy's row work on the GPU, the CUDA twins of
// the element-wise steps of ops/cross_entropy.cpp between its products (which
// run through cuBLASLt): for one row block × vocabulary chunk of f32 logits
// (Bn, Cn), dense with row stride Cn, over device pointers. targets, lse and
// the row statistics are the row block's (Bn) slices, f32 (targets i32).
// Launch on `stream` and return at once; a launch error throws anvil::Error.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace anvil {

// Pass 1, one chunk of vocabulary entries [v0, v0 + Cn): each counted row's
// online log-sum-exp update of row_max and row_sum (Σ exp(logit − row_max)),
// and row_target = its target's logit when the target is in the chunk. With
// first_chunk the rows start afresh (nothing need be initialised); ignored
// rows are then set to −∞, 0, 0 and left alone by later chunks.
void cross_entropy_lse_update_cuda(const float* logits, int64_t Bn, int64_t Cn, int64_t v0, const int32_t* targets,
                                   int32_t ignore_index, bool first_chunk, float* row_max, float* row_sum,
                                   float* row_target, cudaStream_t stream);

// After the last chunk, over all M rows: lse = row_max + log(row_sum) (f32, 0
// for ignored rows), *loss_sum = Σ (lse − target logit) over the counted rows
// in double and *num_tokens their count (device pointers), in an order fixed
// by M alone.
void cross_entropy_loss_cuda(const float* row_max, const float* row_sum, const float* row_target,
                             const int32_t* targets, int32_t ignore_index, int64_t M, float* lse, double* loss_sum,
                             int64_t* num_tokens, cudaStream_t stream);

// Pass 2, one chunk: dlogits = (softmax − onehot(target))·scale from the
// chunk's logits and each row's lse; zero on ignored rows. f32 dlogits may be
// the logits (in place); bf16 (uint16_t bits) go to their own (Bn, Cn) buffer.
template <class T>
void cross_entropy_dlogits_cuda(const float* logits, T* dlogits, int64_t Bn, int64_t Cn, int64_t v0,
                                const int32_t* targets, int32_t ignore_index, const float* lse, float scale,
                                cudaStream_t stream);

}  // namespace anvil
