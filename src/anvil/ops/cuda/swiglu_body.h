// SwiGLU's per-element bodies (kernel_body.h), the CUDA twins of ops/swiglu.h:
// h = silu(g)·u forward; dg = dh·u·silu'(g), du = dh·silu(g) backward. The
// formulas are the CPU op's: the sigmoid from e = exp(−|z|) ∈ (0, 1], which
// never overflows, with s and 1 − s both to full relative precision. f32
// arithmetic, f32 or bf16 storage (bf16 rounded to nearest even once). Every
// output element depends only on the inputs at its index, so the CPU op's
// in-place uses hold here too.
#pragma once
#include <cstdint>

#include "anvil/ops/cuda/kernel_body.h"

namespace anvil::kernel {

constexpr unsigned kSwigluThreads = 256;

inline LaunchShape swiglu_launch_shape(int64_t n) { return {{blocks_for(n, kSwigluThreads), 1}, {kSwigluThreads, 1}}; }

// s = sigmoid(z) and oms = 1 − s.
ANVIL_HD inline void sigmoid_parts(float z, float& s, float& oms) {
  const float e = exp_f32(-(z < 0 ? -z : z));
  const float r = 1.0f / (1.0f + e);
  if (z >= 0) {
    s = r, oms = e * r;
  } else {
    s = e * r, oms = r;
  }
}

template <class T>
ANVIL_HD void swiglu_forward_body(const ThreadPos& pos, const T* g, const T* u, T* h, int64_t n) {
  for (int64_t i = pos.global_x(); i < n; i += pos.grid_stride_x()) {
    const float z = load_f32(g, i);
    float s, oms;
    sigmoid_parts(z, s, oms);
    store_f32(h, i, z * s * load_f32(u, i));
  }
}

template <class T>
ANVIL_HD void swiglu_backward_body(const ThreadPos& pos, const T* dh, const T* g, const T* u, T* dg, T* du, int64_t n) {
  for (int64_t i = pos.global_x(); i < n; i += pos.grid_stride_x()) {
    const float d = load_f32(dh, i), z = load_f32(g, i), up = load_f32(u, i);
    float s, oms;
    sigmoid_parts(z, s, oms);
    store_f32(du, i, d * z * s);
    store_f32(dg, i, d * up * (s * (1.0f + z * oms)));
  }
}

}  // namespace anvil::kernel
