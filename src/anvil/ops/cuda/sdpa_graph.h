// Anvil's causal grouped-query attention as cuDNN frontend graphs: the
// forward (scaled dot-product attention with softmax statistics) and the
// backward of cuDNN's fused SDPA (flash attention), bf16 q/k/v/o with f32
// softmax and products, their tensors declared exactly as ops/sdpa_layout.h
// lays Anvil's (B, T, H, D) tensors and (B, H, T) lse out, used in place.
//
// Only the description: no graph here is validated or built. Describing
// needs no GPU; validate() does (frontend 1.15 asks the CUDA runtime for the
// device's properties when it checks SDPA's support), so the CUDA-free proof
// of these graphs is their serialised form (Graph::serialize), which names
// every tensor's dims, strides and type and the SDPA node's mask and scale.
// ops/cuda/sdpa.h validates, builds, caches and runs them.
//
// The statistics: cuDNN's forward writes Stats = max_j s_ij + ln Σ_j
// exp(s_ij − max_j s_ij) per query row i over its unmasked keys, with
// s_ij = attn_scale · q_i·k_j, and its backward recomputes the softmax as
// exp(s_ij − Stats_i) (the frontend's SDPA composite: "sub_s_m" then exp).
// That is the natural-log log-sum-exp of the scaled scores, exactly the lse
// attention_forward (ops/attention.h) writes and attention_backward reads,
// so lse passes between the CPU and the GPU paths as it is.
//
// A ragged layout (documents, ops/sdpa_layout.h) adds the padding mask with
// the entries' lengths, and a ragged offset on every q, k, v, o-shaped
// tensor and on the stats (token-major then); the backward is also told the
// tokens in all (max_total_seq_len_q and _kv).
#pragma once
#include <cudnn_frontend.h>

#include <cstdint>
#include <memory>

#include "anvil/ops/sdpa_layout.h"

namespace anvil {

// The UIDs that bind the graphs' tensors to device pointers at execution
// (the variant pack); forward and backward share q, k, v, o and stats, and
// under documents the entries' lengths (seq_len_q and seq_len_kv, bound to
// the same array) and ragged offsets: q_offset for q, o, dO and dQ,
// kv_offset for k, v, dK and dV, stats_offset for the stats.
enum class SdpaUid : int64_t {
  q = 1, k, v, o, stats, d_o, dq, dk, dv,
  seq_len_q, seq_len_kv, q_offset, kv_offset, stats_offset
};

// q, k, v in; o and stats (lse) out.
std::shared_ptr<cudnn_frontend::graph::Graph> sdpa_forward_graph(const SdpaLayout& layout);

// q, k, v, o, dO (the loss's gradient on o) and stats (the forward's lse) in;
// dQ, dK, dV out, overwritten. dK and dV sum over the query heads sharing a
// kv head, as attention_backward's do.
std::shared_ptr<cudnn_frontend::graph::Graph> sdpa_backward_graph(const SdpaLayout& layout);

}  // namespace anvil
