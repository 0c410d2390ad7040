// The Llama model: token embedding, n_layers transformer blocks, final RMSNorm
// and the fused output projection + cross-entropy. Forward and backward are
// written out per module (no autograd tape), so exactly what each block keeps
// between forward and backward is decided here, by the activation
// checkpointing policy, and memory is knowable in advance.
#pragma once
#include <memory>
#include <vector>

#include "anvil/core/tensor.h"
#include "anvil/model/args.h"
#include "anvil/model/params.h"
#include "anvil/ops/cross_entropy.h"
#include "anvil/ops/rope.h"

namespace anvil {

// Activation checkpointing, as torchtitan's [activation_checkpoint]:
//   none            every block keeps all it needs for backward
//   selective_layer every k-th block (layers 0, k, 2k, ...) keeps only its input
//                   and recomputes its forward during backward
//   selective_op    every block keeps the outputs of its matrix products and of
//                   attention, and recomputes the cheap element-wise ops and norms
//   full            every block keeps only its input
enum class AcMode { none, selective_layer, selective_op, full };
struct AcPolicy {
  AcMode mode = AcMode::none;
  int every = 2;  // selective_layer's k
};
// From the config strings: mode none|selective|full, option "op" or an integer k.
AcPolicy parse_ac_policy(const std::string& mode, const std::string& selective_option);
const char* ac_mode_name(AcMode m);

// One block's parameters (views into the ParamStore), in compute dtype or as
// the f32 gradients.
struct BlockParams {
  Tensor attention_norm, wq, wk, wv, wo, ffn_norm, w1, w2, w3;
};

// What one block keeps between its forward and its backward; fields the
// policy does not keep are left undefined (and their memory freed).
struct BlockSaved {
  Tensor x;           // (M, D)   block input (always kept)
  Tensor h1, rstd1;   // (M, D), (M)   attention RMSNorm output and 1/rms
  Tensor q, k, v;     // (B, T, H, hd) after RoPE (q, k)
  Tensor o, lse;      // (B, T, Hq, hd), (B, Hq, T)   attention output, log-sum-exp
  Tensor x2;          // (M, D)   residual stream after attention
  Tensor h2, rstd2;   // (M, D), (M)   feed-forward RMSNorm output and 1/rms
  Tensor g, u, s;     // (M, F)   gate, up, silu(g)·u
};

// The seam where data parallelism acts, never inside kernels: the model calls
// these around each parameter group's use (group 0 the embedding, 1 + l block
// l, n_layers + 1 the head). FSDP gathers a group's weights before and
// reshards them and reduce-scatters its gradients after; DDP starts a bucket's
// all-reduce when its backward is done. The head's forward and backward are one
// fused pass: it sees before_forward, before_backward, after_backward.
class ParamGroupHooks {
 public:
  virtual ~ParamGroupHooks() = default;
  virtual void before_forward(int group) {}
  virtual void after_forward(int group) {}
  virtual void before_backward(int group) {}
  virtual void after_backward(int group) {}
};

class Llama {
 public:
  // allocate_params = false: no flat parameter buffers; every group is bound
  // while in use by someone who owns its weights (FSDP).
  Llama(const ModelArgs& args, DType compute_dtype, int64_t max_seq_len, bool allocate_params = true);

  const ModelArgs& args() const { return args_; }
  ParamStore& params() { return params_; }
  const ParamStore& params() const { return params_; }
  DType compute_dtype() const { return params_.compute_dtype(); }

  // One micro-batch: forward, loss and backward. Parameter gradients are
  // accumulated into params().grad_flat() scaled by grad_scale (the trainer
  // passes 1/tokens-in-the-step, so accumulation equals one large batch).
  // tokens, targets (B, T) i32; targets equal to ignore_index carry no loss.
  CrossEntropyResult forward_backward(const Tensor& tokens, const Tensor& targets, float grad_scale,
                                      const AcPolicy& policy);
  // Loss only (evaluation): keeps no activations beyond the current block.
  CrossEntropyResult forward(const Tensor& tokens, const Tensor& targets);

  // Not owned; null: no hooks (a single process).
  void set_hooks(ParamGroupHooks* hooks) { hooks_ = hooks ? hooks : &no_hooks_; }
  int head_group() const { return static_cast<int>(args_.n_layers) + 1; }

 private:
  BlockParams block_compute(int layer) const;
  BlockParams block_grads(int layer) const;
  Tensor embed(const Tensor& tokens) const;
  // Runs block `layer` on saved.x, filling the other fields of saved; returns the block output.
  // recomputing: the same computation, traced as recompute during backward.
  Tensor block_forward(int layer, BlockSaved& saved, int64_t B, int64_t T, bool recomputing = false) const;
  // Drops what `policy` does not keep for this layer.
  void drop_unkept(int layer, BlockSaved& saved, const AcPolicy& policy) const;
  // Brings back what drop_unkept removed.
  void recompute(int layer, BlockSaved& saved, int64_t B, int64_t T) const;
  // dout (M, D) is the gradient of the block output; returns dx (may reuse dout's buffer).
  Tensor block_backward(int layer, BlockSaved& saved, Tensor dout, int64_t B, int64_t T);

  ModelArgs args_;
  ParamStore params_;
  RopeTable rope_;
  int embed_index_, norm_index_, output_index_;
  std::vector<int> block_first_index_;  // index of each block's first parameter
  ParamGroupHooks no_hooks_;
  ParamGroupHooks* hooks_ = &no_hooks_;
};

// The parameter list of a model, with Hugging Face names and torchtitan's
// initialisation scales.
std::vector<ParamSpec> llama_param_specs(const ModelArgs& args);

}  // namespace anvil
