// The fused LM head + cross-entropy on a GPU, the device side of
// cross_entropy_forward and cross_entropy_forward_backward
// (ops/cross_entropy.h), same tensors and meaning, never holding the (M, V)
// logits: the vocabulary in chunks of f32 logits of every row, each a cuBLASLt
// product followed by the row work's kernels (ops/cuda/cross_entropy.h).
//   forward:  per chunk, logits = x·w_cᵀ and the online log-sum-exp; then the
//             loss and each row's lse. The loss and its token count are read
//             back once (a host synchronisation, the step's loss read).
//   backward: per chunk again, logits = x·w_cᵀ (recomputed: keeping them all
//             would be the logits the chunking avoids), dlogits in x's type,
//             dx += dlogits·w_c into an f32 accumulator (bf16 would round at
//             every chunk; cast to dx's type at the end) and
//             dw_c += dlogitsᵀ·x.
// Targets are i32 on the device, checked on the host before they were copied.
#pragma once
#include "anvil/core/tensor.h"
#include "anvil/ops/cross_entropy.h"

namespace anvil {

// Vocabulary entries per chunk for M rows: the f32 logits chunk within 64 MiB,
// a multiple of 128 columns, at least 128, at most V (CrossEntropyOptions'
// vocab_chunk, where set, instead: tests cut small chunks).
int64_t cross_entropy_gpu_chunk(int64_t M, int64_t V);

// dx and dw null: the loss only.
CrossEntropyResult cross_entropy_gpu(const Tensor& x, const Tensor& w, const Tensor& targets,
                                     const CrossEntropyOptions& opt, float grad_scale, Tensor* dx, Tensor* dw);

}  // namespace anvil
