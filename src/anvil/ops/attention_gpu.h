// Attention on a GPU, the device side of attention_forward and
// attention_backward (ops/attention.h), same tensors and meaning (checked by
// them first):
//   bf16: cuDNN's fused SDPA (flash attention), its stats as the lse;
//   f32:  a plain attention for fp32 parity runs, the products through
//         cuBLASLt (TF32 off) and the causal row softmax an own kernel, with
//         the (B, Hq, T, T) scores made in full (parity runs are small).
// Over whole sequences only: a window (context parallelism) and accumulated
// gradients are refused with one line saying what to run instead. Documents
// (block-causal masks) stay on the host, where each call reads them: bf16
// through cuDNN's ragged SDPA (ops/sdpa_layout.h; the documents' pack and
// token-major stats are the call's workspace), f32 by the row softmax's
// first key per row.
#pragma once
#include "anvil/core/tensor.h"
#include "anvil/ops/attention.h"
#include "anvil/ops/gpu_kernels.h"

namespace anvil {

void attention_forward_gpu(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse, float scale,
                           const AttentionWindow& window);
void attention_backward_gpu(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                            const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv, float scale,
                            const AttentionWindow& window, AttentionAccumulate accumulate);

// The workspace bytes cuDNN's SDPA graph of `shape` is given. The GPU's graph
// is asked on a GPU; a dry run, which has none, plans this much: none for
// the forward, and for the backward an f32 dQ accumulator (B·Hq·T·D) and two
// f32 row statistics (B·Hq·T each). Where a GPU's graph asks more, the op
// takes what the graph asks and says once that the dry run planned less.
size_t sdpa_planned_workspace_bytes(bool backward, const SdpaShape& shape);

}  // namespace anvil
