// A mixture-of-experts feed-forward layer (Qwen3-MoE's sparse block), forward
// and backward written out, from the ops:
//
//   logits = x·Wgᵀ (f32)  →  router: softmax, top k, weights  (ops/moe_router.h)
//   routes sorted by expert; xe = dispatch(x)                  (ops/moe_dispatch.h)
//   g = xe·W1[e]ᵀ, u = xe·W3[e]ᵀ, s = silu(g)·u, ye = s·W2[e]ᵀ  (ops/moe_experts.h, ops/swiglu.h)
//   y = Σ_j weights[t, j] · ye[row of (t, j)]                  (combine)
//
// Dropless (no capacity: every token reaches its k experts) and with no
// shared expert, as in Qwen3-MoE. The load-balancing auxiliary loss (Hugging
// Face's, ops/moe_router.h) is returned by the forward; the backward adds
// aux_coef times its gradient to the router's. The choice of experts is
// constant to the backward, as in every MoE implementation.
//
// This is the layer on its own; the block that runs it in place of the dense
// feed-forward, the Qwen3-MoE flavours and expert parallelism build on it.
#pragma once
#include "anvil/core/tensor.h"
#include "anvil/ops/moe_dispatch.h"
#include "anvil/ops/moe_router.h"

namespace anvil {

// The layer's weights in the compute dtype, or (as gradients) f32:
//   router (E, D); w1 gate and w3 up (E, F, D); w2 down (E, D, F).
struct MoeWeights {
  Tensor router, w1, w3, w2;
};

// What the forward keeps for the backward.
struct MoeSaved {
  Tensor probs, experts, weights;  // (M, E) f32, (M, k) i32, (M, k) f32
  ExpertRoutes routes;
  Tensor xe, g, u, s, ye;  // (M·k, D), (M·k, F) ×3, (M·k, D): the dispatched rows and the experts' activations
  double aux_loss = 0;     // this layer's load-balancing loss (before its coefficient)
};

// x (M, D) → y (M, D), x's dtype.
Tensor moe_forward(const Tensor& x, const MoeWeights& w, const RouterConfig& cfg, MoeSaved& saved);

// dy (M, D) → dx (M, D) (overwritten); the weights' gradients are added to
// `grads` (f32, or the compute dtype); saved is consumed.
void moe_backward(const Tensor& dy, const Tensor& x, const MoeWeights& w, const RouterConfig& cfg, float aux_coef,
                  MoeSaved& saved, Tensor& dx, const MoeWeights& grads);

}  // namespace anvil
