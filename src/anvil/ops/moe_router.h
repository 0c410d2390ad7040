// Mixture-of-experts routing, as Qwen3-MoE routes (Hugging Face's
// Qwen3MoeSparseMoeBlock): per token, a softmax over the E experts' router
// logits, the top k experts by probability, and their weights, renormalised to
// sum to 1 (norm_topk_prob) or not. Dropless: every token goes to its k
// experts, whatever their load. Ties go to the lower expert index, so every
// implementation that follows the rule picks the same experts.
//
// The load-balancing auxiliary loss is Hugging Face's load_balancing_loss_func
// for one layer: E · Σ_e (n_e / M) · P_e, with n_e the tokens that chose
// expert e (in any of their k slots) and P_e the mean probability of e over
// the M tokens; the model multiplies it by router_aux_loss_coef. Its gradient
// flows through P_e only (n_e counts choices).
//
// Two options from DeepSeek-V3 (and torchtitan's MoE): sigmoid scores (each
// expert's own sigmoid of its logit instead of a softmax over the experts),
// and an expert bias added to the scores to choose the top k but not to weight
// the chosen (the auxiliary-loss-free balance: the model moves the bias after
// each step, model/moe_feed_forward.h). Under sigmoid scores the aux loss's P_e
// is the mean of each token's scores normalised to sum to 1, as DeepSeek-V3's
// sequence-wise balance loss takes it.
//
// This is the routing step alone (model/moe_feed_forward.h runs the layer
// around it); forward and backward in f32.
#pragma once
#include <cstdint>
#include <vector>

#include "anvil/core/tensor.h"

namespace anvil {

struct RouterConfig {
  int64_t top_k = 1;
  bool normalize = true;  // Qwen3-MoE's norm_topk_prob
  // Forced balance instead of the top k: the token at position p of its
  // sequence sends slot j to expert (p·k + j) mod E, so every expert gets
  // M·k/E routes (±1) whatever the logits, and a token's experts do not
  // depend on how the sequences are split over micro-batches and ranks; the
  // weights are still the softmax's at those experts. The dry run takes this
  // case (sort_routes), and a real run under it allocates the same.
  bool balanced = false;
  int64_t sequence_length = 0;  // the rows' sequences' length, for `balanced` (0: one sequence of all M rows)
  // For `balanced`: each row's position in its sequence (M values), when the
  // rows are not whole sequences from position 0 (context parallelism's chunks).
  const int64_t* positions = nullptr;
  bool sigmoid = false;         // sigmoid scores (DeepSeek-V3) instead of the softmax
  const float* bias = nullptr;  // E values added to the scores for the choice only; null: none
};

// The forced-balance rule, written once for the router and the dry run: the
// position of row t as the rule reads it (cfg.positions, else t mod the
// sequence length), and the expert it sends slot j to.
inline int64_t balanced_position(const RouterConfig& cfg, int64_t t) {
  return cfg.positions ? cfg.positions[t] : cfg.sequence_length > 0 ? t % cfg.sequence_length : t;
}
inline int32_t balanced_expert(int64_t position, int64_t slot, int64_t top_k, int64_t num_experts) {
  return static_cast<int32_t>((position * top_k + slot) % num_experts);
}
// The rows per expert the rule gives M rows under cfg, as offsets (E + 1):
// what sort_routes makes of the router's choices, found without them (the
// rule reads positions only), so a dry run routes exactly as the real run.
std::vector<int64_t> balanced_route_offsets(int64_t M, int64_t num_experts, const RouterConfig& cfg);

// logits (M, E) f32 → probs (M, E) f32 (the scores: the softmax, or the
// sigmoids; kept for the backward), experts (M, k) i32 (in descending score
// plus bias, ties to the lower index; or the balanced rule's) and weights
// (M, k) f32 (the chosen scores, renormalised to sum to 1 when cfg.normalize).
void router_forward(const Tensor& logits, const RouterConfig& cfg, Tensor& probs, Tensor& experts, Tensor& weights);

// dlogits (M, E) f32 = the gradient of Σ dweights · weights through the
// top-k weights and the scores (the choice of experts is constant);
// overwritten, or added to when accumulate.
void router_backward(const Tensor& probs, const Tensor& experts, const Tensor& dweights, const RouterConfig& cfg,
                     Tensor& dlogits, bool accumulate = false);

// The auxiliary loss E · Σ_e (n_e / M) · P_e of this layer's routing (P_e
// over each token's normalised sigmoid scores when sigmoid); when dlogits is
// given, adds coef times its gradient there.
double router_aux_loss(const Tensor& probs, const Tensor& experts, float coef = 0.0f, Tensor* dlogits = nullptr,
                       bool sigmoid = false);

// The same in parts, for a sequence whose tokens lie in several places (its
// chunks on the ranks of a context-parallel group): the sums over some of its
// tokens — n_e, Σ_t of each token's share of e, and the tokens — add up to the
// whole sequence's, whose loss and gradient follow from them.
struct RouterAuxSums {
  std::vector<double> chose, share;  // E each
  double tokens = 0;
};
// Adds rows' counts and shares to `sums` (sized E on first use).
void router_aux_sums(const Tensor& probs, const Tensor& experts, bool sigmoid, RouterAuxSums& sums);
double router_aux_loss(const RouterAuxSums& sums);
// Adds coef times the gradient of router_aux_loss(sums) with respect to these
// rows' logits to dlogits (the rows' probs and dlogits; sums the whole sequence's).
void router_aux_backward(const Tensor& probs, const RouterAuxSums& sums, float coef, Tensor& dlogits, bool sigmoid);

}  // namespace anvil
