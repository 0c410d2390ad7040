// One Llama transformer block, forward and backward side by side:
//   attention     h1 = norm(x); q, k, v = h1·W{q,k,v}ᵀ; (Qwen3: q, k = norm per head);
//                 RoPE; o = attention(q, k, v); x2 = x + o·Woᵀ
//   feed-forward  h2 = norm(x2); out = x2 + (silu(h2·W1ᵀ) ⊙ h2·W3ᵀ)·W2ᵀ
//                 (Qwen3-MoE: out = x2 + moe(h2), model/moe_feed_forward.h)
// The block owns no activations: its forward fills a BlockSaved record that the
// caller (a schedule) keeps until the block's backward consumes it. The
// backward runs whole, or as two passes — input gradient, then weight
// gradient — for zero-bubble pipeline schedules; both give the same numbers.
#pragma once
#include <functional>
#include <vector>

#include "anvil/core/tensor.h"
#include "anvil/model/activation_checkpoint.h"
#include "anvil/model/args.h"
#include "anvil/model/moe_feed_forward.h"
#include "anvil/model/parallel_style.h"
#include "anvil/model/params.h"
#include "anvil/ops/rope.h"

namespace anvil {

// One block's parameters (views into the ParamStore), in compute dtype or as
// the f32 gradients.
struct BlockParams {
  Tensor attention_norm, wq, wk, wv, wo, ffn_norm, w1, w2, w3;
  Tensor q_norm, k_norm;  // (head_dim) Qwen3's per-head norms, or undefined
  MoeWeights moe;         // a mixture-of-experts feed-forward's (then w1, w2, w3 are undefined)
};

// What one block keeps between its forward and its backward; fields the
// policy does not keep are left undefined (and their memory freed).
struct BlockSaved {
  int64_t B = 0, T = 0;  // the micro-batch: B sequences of T tokens, M = B·T rows
  Tensor documents;      // the micro-batch's document bounds (attention.h), or undefined: causal (always kept)
  Tensor x;           // (M, D)   block input (always kept)
  Tensor h1, rstd1;   // (M, D), (M)   attention RMSNorm output and 1/rms
  Tensor q_raw, k_raw;    // (B, T, H, hd) the projections before the q/k norms (Qwen3 only)
  Tensor rstd_q, rstd_k;  // (M·H)   their 1/rms per head (Qwen3 only)
  Tensor q, k, v;     // (B, T, H, hd) after the q/k norms and RoPE (q, k)
  Tensor o, lse;      // (B, T, Hq, hd), (B, Hq, T)   attention output, log-sum-exp
  Tensor x2;          // (M, D)   residual stream after attention
  Tensor h2, rstd2;   // (M, D), (M)   feed-forward RMSNorm output and 1/rms
  Tensor g, u, s;     // (M, F)   gate, up, silu(g)·u
  MoeSaved moe;       // a mixture-of-experts feed-forward's record (in place of g, u, s)
};

// The weight-gradient products an input-gradient pass leaves for the
// weight-gradient pass, holding the tensors they read.
struct WeightGradWork {
  struct Product {
    Tensor dy, x, grad;  // grad (N, K) += dyᵀ (N, M) · x (M, K)
  };
  std::vector<Product> products;
};

class TransformerBlock {
 public:
  // params: the model's store; first_param: the index of the block's first
  // parameter (input_layernorm), the rest following in llama_param_specs'
  // order. layer: its number in the whole model. The heads and feed-forward
  // width it runs are its parameters' (a tensor-parallel rank holds a share).
  // moe_state: where a mixture-of-experts block reports its routing and
  // reads its auxiliary loss's gradient scale (the model's; null if dense).
  // exchange: the expert-parallel group, whose share of the experts the
  // block's parameters hold (null: all of them).
  TransformerBlock(ParamStore& params, int first_param, int layer, const ModelArgs& args, const RopeTable& rope,
                   const ParallelStyle& style, MoeStepState* moe_state = nullptr, ExpertExchange* exchange = nullptr);
  int layer() const { return layer_; }

  // x (residual_rows(M), D) → the block output, same shape. saved gets x and
  // what `policy` keeps for this layer; the rest is freed before returning.
  // documents: the sequences' document bounds (AttentionWindow::documents:
  // block-causal attention), or undefined for causal attention.
  Tensor forward(const Tensor& x, int64_t B, int64_t T, const AcPolicy& policy, BlockSaved& saved,
                 const Tensor& documents = {}) const;
  // Evaluation: keeps nothing.
  Tensor forward(const Tensor& x, int64_t B, int64_t T, const Tensor& documents = {}) const;
  // Inference with a key/value cache (a single process): x (B·T, D) holds T
  // new tokens of each of B sequences; sequence b's sit at positions
  // positions[b] .. + T − 1 and its keys and values live in slot slots[b] of
  // cache_k and cache_v (slots, capacity, Hkv, head_dim). The new tokens' keys
  // and values are written there and their queries attend to the slot's rows
  // up to their own position. Returns the block output (B·T, D); keeps nothing.
  Tensor forward_cached(const Tensor& x, int64_t T, const std::vector<int64_t>& slots,
                        const std::vector<int64_t>& positions, Tensor& cache_k, Tensor& cache_v) const;

  // dout: the gradient of the block output; returns the gradient of its input
  // (in dout's buffer) and accumulates the parameter gradients. saved is
  // consumed (left empty).
  Tensor backward(BlockSaved& saved, Tensor dout);
  // The same as two passes: the input gradient now, and the weight-gradient
  // products left in `work` for backward_weight.
  Tensor backward_input(BlockSaved& saved, Tensor dout, WeightGradWork& work);
  void backward_weight(WeightGradWork& work);

 private:
  BlockParams compute_params() const;
  BlockParams grad_params() const;
  // Runs the block on saved.x, filling every other field; returns its output.
  Tensor run_forward(BlockSaved& s, bool recomputing) const;
  // Its second half, from s.x2: the feed-forward and the residual.
  Tensor run_feed_forward(BlockSaved& s, bool recomputing) const;
  void drop_unkept(BlockSaved& s, const AcPolicy& policy) const;
  void recompute(BlockSaved& s) const;  // brings back what drop_unkept removed
  // work null: weight gradients at once (the fused backward).
  Tensor run_backward(BlockSaved& s, Tensor dout, WeightGradWork* work);

  ParamStore& params_;
  int first_param_, layer_;
  // Projects h1 (M, D) onto the query (or, keys, key) heads (B, T, H, hd)
  // through w; with the q/k norms, the projection goes to raw and is
  // normalised per head into out (rstd its 1/rms), else straight into out.
  void project_heads(const Tensor& h1, const Tensor& w, const Tensor& norm, Tensor& out, Tensor& raw,
                     Tensor& rstd, bool keys) const;

  // The dense or the MoE feed-forward, forward and backward (dh2 from dout).
  Tensor feed_forward(BlockSaved& s, const BlockParams& p) const;
  // weight_grad(dy, x, grad): grad += dyᵀ·x, now or in the weight-gradient pass.
  using WeightGrad = std::function<void(const Tensor& dy, const Tensor& x, Tensor& grad)>;
  Tensor feed_forward_backward(BlockSaved& s, const BlockParams& p, BlockParams& gp, const Tensor& dout,
                               const WeightGrad& weight_grad) const;
  // A training forward's routing into moe_state_ (before the policy drops it).
  void report_routing(const BlockSaved& s) const;

  int64_t dim_, head_dim_, heads_, kv_heads_, ffn_;
  int q_norm_param_;  // the offset of q_norm from the first parameter (k_norm follows)
  bool qk_norm_;
  RouterConfig router_;  // top_k 0: a dense feed-forward
  int local_experts_;    // the experts this rank holds (all of them without expert parallelism)
  MoeStepState* moe_state_;
  ExpertExchange* exchange_;
  float eps_;
  const RopeTable& rope_;
  const ParallelStyle& style_;
};

}  // namespace anvil
