// SwiGLU, the activation of the Llama feed-forward block:
//   h = silu(g) ⊙ u,   silu(z) = z·sigmoid(z),
// where g = x·W1ᵀ (gate) and u = x·W3ᵀ (up) come from two linear layers and h
// feeds the down projection W2. Element-wise, so these kernels are (nearly)
// memory-bound: one pass, vectorised, parallel over chunks of elements.
//
// Storage is f32 or bf16 (all tensors of one call share the dtype); the maths
// is f32 either way, and bf16 outputs are rounded to nearest even once (with
// the AVX512-BF16 instruction where available, which flushes f32 denormal
// results, |x| < 1.2e-38, to zero as AMX does).
//
// The sigmoid is computed from exp(−|z|) ∈ (0, 1], which never overflows, so
// any finite z (e.g. ±80, ±1e4) gives finite, accurate results; NaN in g or u
// propagates to the outputs.
//
// In-place use: every output element depends only on the input elements at
// the same index, and each block of inputs is read before its outputs are
// written. So any output may be the very same tensor (same buffer, same
// offset) as any input:
//   forward:  h may be g or u;
//   backward: dg and du may each be dh, g or u (e.g. dg into g and du into u
//             once the saved activations are no longer needed),
// but dg and du must be different tensors, and partially overlapping views
// (an offset other than zero between output and input) are not allowed.
#pragma once
#include "anvil/core/tensor.h"

namespace anvil {

// g (M, F)  gate pre-activation
// u (M, F)  up projection
// h (M, F)  output silu(g)·u, overwritten
// Any shape works as long as all tensors have the same shape and dtype.
void swiglu_forward(const Tensor& g, const Tensor& u, Tensor& h);

// dh (M, F)  gradient of the loss with respect to h
// g  (M, F)  gate pre-activation saved from the forward pass
// u  (M, F)  up projection saved from the forward pass
// dg (M, F)  overwritten with dh·u·silu'(g),  silu'(z) = s·(1 + z·(1 − s)), s = sigmoid(z)
// du (M, F)  overwritten with dh·silu(g)
void swiglu_backward(const Tensor& dh, const Tensor& g, const Tensor& u, Tensor& dg, Tensor& du);

}  // namespace anvil
