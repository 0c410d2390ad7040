// The Llama model as an ordered list of modules:
//   module 0            token embedding        (token_embedding.h)
//   modules 1..n        the n_layers transformer blocks (transformer_block.h)
//   module n + 1        final norm, output head and loss (output_head.h)
// A Llama object holds contiguous slices of that list — pipeline stages, one
// or several per rank; a single process holds all of it as one — with the
// parameters of its modules only.
// Forward and backward are written out per module (no autograd tape), so what
// each block keeps between them is decided by the activation-checkpointing
// policy and memory is knowable in advance. A micro-batch's saved state is a
// StageSaved record owned by the caller (the schedule), not by the model.
// Parallelisms are applied from outside: a ParallelStyle (parallel_style.h) gives
// this rank's parameter slices and the collectives at the seams, and
// ParamGroupHooks let data parallelism act around each module.
#pragma once
#include <memory>
#include <vector>

#include "anvil/core/tensor.h"
#include "anvil/model/activation_checkpoint.h"
#include "anvil/model/args.h"
#include "anvil/model/kv_cache.h"
#include "anvil/model/output_head.h"
#include "anvil/model/parallel_style.h"
#include "anvil/model/cast_on_use.h"
#include "anvil/model/params.h"
#include "anvil/model/token_embedding.h"
#include "anvil/model/transformer_block.h"
#include "anvil/ops/cross_entropy.h"
#include "anvil/ops/rope.h"

namespace anvil {

// Modules in the whole model: the embedding, the blocks, the head.
inline int llama_num_modules(const ModelArgs& args) { return static_cast<int>(args.n_layers) + 2; }

// A pipeline stage: modules [first, end) of the whole model's list.
struct ModuleRange {
  int first = 0, end = 0;
  bool operator==(const ModuleRange&) const = default;
};

// The experts of a mixture of experts one rank holds under expert parallelism.
struct ExpertShard {
  int rank = 0, size = 1;
  bool operator==(const ExpertShard&) const = default;
};

struct LlamaOptions {
  // The stages this rank holds, in ascending module order, disjoint (several
  // for looped and V-shaped pipeline schedules); empty: the whole model as one.
  std::vector<ModuleRange> stages = {};
  // How this rank holds and runs its modules (not owned); null: a single process.
  const ParallelStyle* parallel_style = nullptr;
  // false: no flat parameter buffers; every group is bound while in use by
  // someone who owns its weights (FSDP).
  bool allocate_params = true;
  // In bf16: a bf16 copy of every weight kept, or each group's cast while it
  // runs (ParamStore's ComputeCopy), by the model's own CastOnUse hooks
  // (model/cast_on_use.h) and this rule of when a cast is let go.
  ComputeCopy compute_copy = ComputeCopy::whole;
  ReshardPolicy cast_reshard = ReshardPolicy::default_policy;
  // Expert parallelism (a mixture of experts): this rank holds experts
  // [rank·E/size, (rank+1)·E/size) of every layer and exchanges routed rows
  // through `expert_exchange` (not owned; null when size is 1).
  ExpertShard expert_shard = {};
  ExpertExchange* expert_exchange = nullptr;
};

// One micro-batch's state on a stage between its forward and its backward
// (and, when the backward runs as an input-gradient pass and a weight-gradient
// pass, between the two).
struct StageSaved {
  int64_t B = 0, T = 0;
  Tensor tokens;                   // the first stage's input (the embedding's backward reads it)
  std::vector<BlockSaved> blocks;  // one per block of the stage
  Tensor output;                   // on the last stage: the head's input, freed by its backward
  // Between backward_input and backward_weight: each block's weight-gradient
  // products, and on the first stage the gradient the embedding's backward reads.
  std::vector<WeightGradWork> weight_work;
  Tensor d_embedding;
};

class Llama {
 public:
  Llama(const ModelArgs& args, DType compute_dtype, int64_t max_seq_len, const LlamaOptions& options = {});
  Llama(const Llama&) = delete;
  Llama& operator=(const Llama&) = delete;

  const ModelArgs& args() const { return args_; }
  ParamStore& params() { return params_; }
  const ParamStore& params() const { return params_; }
  DType compute_dtype() const { return params_.compute_dtype(); }
  // The positions its RoPE table covers: the longest sequence it runs.
  int64_t max_seq_len() const { return rope_.max_positions(); }
  // The stages this rank holds, numbered 0.. here (the pipeline numbers them globally).
  int num_stages() const { return static_cast<int>(stages_.size()); }
  bool has_embedding() const { return embedding_ != nullptr; }
  bool has_head() const { return head_ != nullptr; }
  // The hooks' group number of module `module` of the whole model (which this
  // rank holds): its position among the modules this rank holds.
  int group_of_module(int module) const;
  // Rows of the residual stream (a stage's input and output) this rank holds
  // of a micro-batch's M token rows.
  int64_t residual_rows(int64_t M) const { return style_->residual_rows(M); }

  // ---- One stage, one micro-batch ----
  // `stage` indexes this rank's stages; the overloads without it are for a
  // rank holding one. input: tokens (B, T) i32 on the stage holding the
  // embedding, else the previous stage's output (residual_rows(B·T), D).
  // Returns the stage's output; the stage holding the head also keeps it in
  // saved for backward_from_loss. documents: the micro-batch's document
  // bounds (B, 2, T) for block-causal attention (ops/document_mask.h; under
  // context parallelism over the whole sequences), undefined for causal.
  Tensor forward(int stage, const Tensor& input, int64_t B, int64_t T, const AcPolicy& policy, StageSaved& saved,
                 const Tensor& documents = {});
  Tensor forward(const Tensor& input, int64_t B, int64_t T, const AcPolicy& policy, StageSaved& saved,
                 const Tensor& documents = {}) {
    return forward(0, input, B, T, policy, saved, documents);
  }
  // A stage without the head: d_output is the gradient of its output. Returns
  // the gradient of its input (undefined on the first stage). Parameter
  // gradients accumulate into params().grad_flat(). saved is consumed.
  // BackwardPart::input leaves the weight gradients of the blocks and the
  // embedding in saved for backward_weight (zero-bubble schedules' I and W).
  enum class BackwardPart { whole, input };
  Tensor backward(int stage, StageSaved& saved, Tensor d_output, BackwardPart part = BackwardPart::whole);
  Tensor backward(StageSaved& saved, Tensor d_output) { return backward(0, saved, std::move(d_output)); }
  // The stage holding the head: the head's loss over targets (B, T) i32
  // (ignore_index carries none) and the backward of grad_scale · loss_sum
  // through the stage. d_input, if given, gets the gradient of the stage's
  // input. With BackwardPart::input the head's weight gradients are made at
  // once (its pass is fused) and the blocks' are left for backward_weight.
  CrossEntropyResult backward_from_loss(int stage, StageSaved& saved, const Tensor& targets, float grad_scale,
                                        Tensor* d_input = nullptr, BackwardPart part = BackwardPart::whole);
  CrossEntropyResult backward_from_loss(StageSaved& saved, const Tensor& targets, float grad_scale,
                                        Tensor* d_input = nullptr) {
    return backward_from_loss(0, saved, targets, grad_scale, d_input);
  }
  // The weight gradients a BackwardPart::input backward left; saved is consumed.
  void backward_weight(int stage, StageSaved& saved);

  // Evaluation on the stage holding the head: the loss of the output its
  // forward kept, without gradients; saved is released.
  CrossEntropyResult loss(StageSaved& saved, const Tensor& targets);
  // The logits of the output the head's stage kept (training never forms
  // them): the pipeline's keep-outputs diagnostic.
  Tensor logits(const StageSaved& saved);

  // ---- The whole model ----
  // One micro-batch: forward, loss and backward. The trainer passes grad_scale
  // = 1/tokens-in-the-step, so accumulation equals one large batch.
  CrossEntropyResult forward_backward(const Tensor& tokens, const Tensor& targets, float grad_scale,
                                      const AcPolicy& policy, const Tensor& documents = {});
  // Loss only (evaluation): keeps no activations beyond the current block.
  CrossEntropyResult forward(const Tensor& tokens, const Tensor& targets, const Tensor& documents = {});
  // Inference with a key/value cache (the whole model on one process):
  // tokens (B, T) i32, T new tokens of each of B sequences, sequence b's at
  // positions positions[b] .. + T − 1 with its keys and values in cache slot
  // slots[b]. Returns the logits of each sequence's last new token, (B, vocab)
  // in the compute dtype. Prefill is T = the prompt's length at position 0;
  // each decoding step is T = 1 at the sequence's length so far.
  Tensor forward_cached(const Tensor& tokens, const std::vector<int64_t>& slots, const std::vector<int64_t>& positions,
                        KvCache& cache);

  // Not owned; null: no hooks (a single process). Under a per-group cast
  // they run inside the model's casts (CastOnUse).
  void set_hooks(ParamGroupHooks* hooks);
  // Frees the casts a group keeps for a backward that will not come (after an
  // evaluation, a step stopped mid-way, or a load of the master weights).
  void release_casts() {
    if (cast_) cast_->release();
  }

  // ---- Mixture of experts ----
  // What the MoE layers did this step and the scale of their auxiliary
  // loss's gradient (moe_feed_forward.h); null for a dense model.
  MoeStepState* moe_state() { return args_.moe() ? &moe_state_ : nullptr; }
  // Before a training step of a MoE model: the sequences it trains on over
  // every rank, over which the auxiliary loss is a mean.
  void set_step_sequences(int64_t sequences);
  // After a training step of a MoE model with the auxiliary-loss-free
  // balance (ModelArgs::moe_bias_update_rate): moves the experts' biases by
  // the step's routes per layer and expert over every rank ((n_layers, E),
  // MoeReport::routes). A no-op otherwise.
  void update_expert_bias(const std::vector<double>& routes);

 private:
  struct Stage {
    ModuleRange modules;
    size_t first_block = 0, num_blocks = 0;  // its blocks in blocks_
    bool embedding = false, head = false;
  };
  const Stage& stage_at(int stage) const;
  Tensor backward_blocks(const Stage& st, StageSaved& saved, Tensor dh, BackwardPart part);
  void embedding_backward(StageSaved& saved, const Tensor& dh);

  ModelArgs args_;
  std::vector<Stage> stages_;
  std::vector<int> held_modules_;  // ascending: the group numbers' order
  ParallelStyle single_process_;
  const ParallelStyle* style_;
  ParamStore params_;
  RopeTable rope_;
  std::unique_ptr<TokenEmbedding> embedding_;  // null unless this rank holds module 0
  std::vector<TransformerBlock> blocks_;       // every stage's, in module order
  std::unique_ptr<OutputHead> head_;           // null unless this rank holds the last module
  ParamGroupHooks no_hooks_;
  std::unique_ptr<CastOnUse> cast_;  // with ComputeCopy::per_group in bf16
  ParamGroupHooks* hooks_ = &no_hooks_;
  MoeStepState moe_state_;  // the blocks hold its address: Llama is not copied or moved
  ExpertExchange* expert_exchange_ = nullptr;
};

// The whole model's parameter list, with Hugging Face names, torchtitan's
// initialisation scales, and group = module index (0 the embedding, 1 + l
// block l, n_layers + 1 the final norm and output head).
std::vector<ParamSpec> llama_param_specs(const ModelArgs& args);
// The parameters of the stages a rank holds (ascending, disjoint module
// ranges), their groups renumbered from 0 in module order. Throws
// anvil::Error for an empty, out-of-range or overlapping range, or stages
// that split tied embeddings from the head.
std::vector<ParamSpec> llama_param_specs(const ModelArgs& args, const std::vector<ModuleRange>& stages,
                                         const ExpertShard& experts = {});
inline std::vector<ParamSpec> llama_param_specs(const ModelArgs& args, int first, int end) {
  return llama_param_specs(args, std::vector<ModuleRange>{{first, end}});
}

}  // namespace anvil
