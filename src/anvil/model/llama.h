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
#include "anvil/model/tensor_parallel.h"
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
  // tp: the tensor-parallel context (not owned), or null for none — then the
  // model runs exactly the single-process code. With it, the parameters are
  // this rank's slices (llama_param_specs) and the forward and backward
  // communicate over the tp group at the seams described in llama.cpp.
  Llama(const ModelArgs& args, DType compute_dtype, int64_t max_seq_len, bool allocate_params = true,
        TensorParallel* tp = nullptr);

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
  TensorParallel* tensor_parallel() const { return tp_; }

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

  // Tensor-parallel seams; without tp_ each is the single-process step.
  // Rows of the residual stream on this rank: M, or M/tp under sequence parallelism.
  int64_t residual_rows(int64_t M) const;
  // local (M/tp, D) → (M, D) gathered over tp under sequence parallelism; else local itself.
  Tensor gather_rows(const Tensor& local, const char* tag) const;
  // residual + in·wᵀ for a row-parallel w (its columns split): each rank's product is a partial sum,
  // reduced over tp (all-reduce, or reduce-scatter to this rank's rows under sequence parallelism).
  // Returns (residual_rows(M), D) in the compute dtype.
  Tensor row_parallel_out(const Tensor& residual, const Tensor& in, const Tensor& w, const char* tag) const;
  // The gradient of a column-parallel product's input, partial (M, D) f32 on each rank, reduced
  // like row_parallel_out's output. Returns (residual_rows(M), D) in the compute dtype.
  Tensor reduce_input_grad(const Tensor& partial, const char* tag) const;
  // The head under tensor parallelism: loss over the vocabulary shards (or the gathered
  // weight with loss parallel off). hn (M, D) gathered; dhn gets (residual_rows(M), D).
  CrossEntropyResult head_tp_forward_backward(const Tensor& hn, const Tensor& targets, float grad_scale,
                                              Tensor& dhn);
  CrossEntropyResult head_tp_forward(const Tensor& hn, const Tensor& targets) const;
  // Loss parallel's statistics combined over tp: writes each row's log-sum-exp over the whole vocabulary.
  CrossEntropyResult loss_parallel_lse(const Tensor& hn, const Tensor& w, const Tensor& targets, Tensor& lse) const;
  // The whole output weight (padded vocabulary, (V_p, D)) gathered over tp.
  Tensor gather_output_weight() const;

  ModelArgs args_;
  ParamStore params_;
  RopeTable rope_;
  int embed_index_, norm_index_, output_index_;
  std::vector<int> block_first_index_;  // index of each block's first parameter
  ParamGroupHooks no_hooks_;
  ParamGroupHooks* hooks_ = &no_hooks_;
  TensorParallel* tp_ = nullptr;
  // This rank's share: n_heads/tp query heads, n_kv_heads/tp KV heads, ffn_hidden/tp feed-forward
  // columns, and the real (unpadded) vocabulary rows [vocab_begin_, vocab_begin_ + vocab_rows_).
  int64_t heads_ = 0, kv_heads_ = 0, ffn_ = 0, vocab_begin_ = 0, vocab_rows_ = 0;
};

// The parameter list of a model, with Hugging Face names and torchtitan's
// initialisation scales. Under tensor parallelism (tp_size > 1) the shapes are
// tp rank tp_rank's slices, each spec's `tp` saying where it sits in the global
// tensor (Megatron's layout):
//   q_proj, k_proj, v_proj, gate_proj, up_proj   column-parallel: output rows split
//                                                (q: n_heads/tp heads, k/v: n_kv_heads/tp)
//   o_proj, down_proj                            row-parallel: input columns split
//   embed_tokens, lm_head                        vocabulary-parallel: rows split, the
//                                                vocabulary padded to a multiple of tp
//   the RMSNorm weights                          replicated
// Throws anvil::Error when tp does not divide the heads or the feed-forward width.
std::vector<ParamSpec> llama_param_specs(const ModelArgs& args, int tp_rank = 0, int tp_size = 1);

}  // namespace anvil
