// Anvil's attention tensors (ops/attention.h) as cuDNN's scaled dot-product
// attention declares them (cudnn-frontend's graph sdpa and sdpa_backward).
// Plain C++, no cuDNN headers: the layout is proved on any host
// (tests/sdpa_layout_test.cpp reads the tensors through it alone) and the
// CUDA side only copies it into the graph's tensor attributes.
//
// cuDNN's SDPA takes every tensor as logical dims [B, H, S, D] with a stride
// per dim (in elements), whatever the memory order: Anvil's (B, T, H, D)
// row-major tensors are its "BSHD" layout, used in place, no transpose. Its
// softmax statistics are [B, H, S, 1] f32, max + ln Σ exp(score − max) per
// query row (natural log unless stats_use_log2 is asked for): exactly Anvil's
// lse (B, H, T). Grouped-query attention needs only H_kv < H_q on k and v;
// query head h reads kv head h / (H_q / H_kv), as Anvil's attention does.
//
// cuDNN runs SDPA on fp16, bf16 or fp8 q/k/v/o (not f32) with a head dim that
// is a multiple of 8 (16 for fp8); the GPU path stores them in bf16. Strides
// are in elements, so the layout is the same for any element type.
#pragma once
#include <array>
#include <cstdint>

namespace anvil {

// One tensor as a cuDNN graph declares it (Tensor_attributes' set_dim and
// set_stride): element [i0, i1, i2, i3] at Σ i·stride from its pointer.
struct CudnnTensorLayout {
  std::array<int64_t, 4> dim{}, stride{};
  int64_t offset(int64_t i0, int64_t i1, int64_t i2, int64_t i3) const {
    return i0 * stride[0] + i1 * stride[1] + i2 * stride[2] + i3 * stride[3];
  }
};

struct SdpaLayout {
  int64_t b = 0, h_q = 0, h_kv = 0, s_q = 0, s_kv = 0, d = 0;
  // q and o (and, backward, dO and dQ): [b, h_q, s_q, d]; k and v (dK, dV): [b, h_kv, s_kv, d].
  CudnnTensorLayout q, k, v, o;
  CudnnTensorLayout stats;  // [b, h_q, s_q, 1], f32: Anvil's lse
  float attn_scale = 0;     // Anvil's scale, 1/sqrt(d) when 0
  // Anvil's causal mask: query row i sees keys 0..i. cuDNN: diagonal
  // alignment TOP_LEFT with right bound 0 (masks columns beyond row + 0).
  bool causal_top_left = true;
  int64_t diagonal_right_bound = 0;
  bool stats_use_log2 = false;  // natural-log stats, as Anvil's lse and cuDNN's backward expect
};

// The layout of attention over q (B, T, Hq, D) and k, v (B, T, Hkv, D), with
// Anvil's `scale` (0 meaning 1/sqrt(D)). Throws anvil::Error, naming the
// shape, for what cuDNN's SDPA cannot take: Hq not a multiple of Hkv, or D not
// a multiple of 8.
SdpaLayout sdpa_layout_of(int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, float scale);

}  // namespace anvil
