// The Llama model as an ordered list of modules:
//   module 0            token embedding        (token_embedding.h)
//   modules 1..n        the n_layers transformer blocks (transformer_block.h)
//   module n + 1        final norm, output head and loss (output_head.h)
// A Llama object holds a contiguous slice of that list — a pipeline stage; a
// single process holds all of it — with the parameters of its modules only.
// Forward and backward are written out per module (no autograd tape), so what
// each block keeps between them is decided by the activation-checkpointing
// policy and memory is knowable in advance. A micro-batch's saved state is a
// StageSaved record owned by the caller (the schedule), not by the model.
// Parallelisms are applied from outside: a ParallelPlan (parallel_plan.h) gives
// this rank's parameter slices and the collectives at the seams, and
// ParamGroupHooks let data parallelism act around each module.
#pragma once
#include <memory>
#include <vector>

#include "anvil/core/tensor.h"
#include "anvil/model/activation_checkpoint.h"
#include "anvil/model/args.h"
#include "anvil/model/output_head.h"
#include "anvil/model/parallel_plan.h"
#include "anvil/model/params.h"
#include "anvil/model/token_embedding.h"
#include "anvil/model/transformer_block.h"
#include "anvil/ops/cross_entropy.h"
#include "anvil/ops/rope.h"

namespace anvil {

// The seam where data parallelism acts, never inside kernels: the model calls
// these around each module's use, numbering the modules it holds from 0 (each
// module's parameters are one group; see Llama::group_of_module). FSDP gathers
// a group's weights before and reshards them and reduce-scatters its gradients
// after; DDP starts a bucket's all-reduce when its backward is done. The head's
// forward and backward are one fused pass: it sees before_forward,
// before_backward, after_backward.
class ParamGroupHooks {
 public:
  virtual ~ParamGroupHooks() = default;
  virtual void before_forward(int group) {}
  virtual void after_forward(int group) {}
  virtual void before_backward(int group) {}
  virtual void after_backward(int group) {}
};

// Modules in the whole model: the embedding, the blocks, the head.
inline int llama_num_modules(const ModelArgs& args) { return static_cast<int>(args.n_layers) + 2; }

struct LlamaOptions {
  // The stage: modules [first_module, end_module) of the whole model's list;
  // end_module -1 means through the last.
  int first_module = 0, end_module = -1;
  // How this rank holds and runs its modules (not owned); null: a single process.
  const ParallelPlan* plan = nullptr;
  // false: no flat parameter buffers; every group is bound while in use by
  // someone who owns its weights (FSDP).
  bool allocate_params = true;
};

// One micro-batch's state on a stage between its forward and its backward.
struct StageSaved {
  int64_t B = 0, T = 0;
  Tensor tokens;                   // the first stage's input (the embedding's backward reads it)
  std::vector<BlockSaved> blocks;  // one per block of the stage
  Tensor output;                   // on the last stage: the head's input, freed by its backward
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
  bool has_embedding() const { return embedding_ != nullptr; }
  bool has_head() const { return head_ != nullptr; }
  // The hooks' group number of module `module` of the whole model (which this stage holds).
  int group_of_module(int module) const { return module - first_module_; }
  // Rows of the residual stream (a stage's input and output) this rank holds
  // of a micro-batch's M token rows.
  int64_t residual_rows(int64_t M) const { return plan_->residual_rows(M); }

  // ---- One stage, one micro-batch ----
  // input: tokens (B, T) i32 on the first stage, else the previous stage's
  // output (residual_rows(B·T), D). Returns this stage's output; the last
  // stage also keeps it in saved for backward_from_loss.
  Tensor forward(const Tensor& input, int64_t B, int64_t T, const AcPolicy& policy, StageSaved& saved);
  // A stage that is not last: d_output is the gradient of its output. Returns
  // the gradient of its input (undefined on the first stage). Parameter
  // gradients accumulate into params().grad_flat(). saved is consumed.
  Tensor backward(StageSaved& saved, Tensor d_output);
  // The last stage: the head's loss over targets (B, T) i32 (ignore_index
  // carries none) and the backward of grad_scale · loss_sum through the stage.
  // d_input, if given, gets the gradient of the stage's input.
  CrossEntropyResult backward_from_loss(StageSaved& saved, const Tensor& targets, float grad_scale,
                                        Tensor* d_input = nullptr);

  // Evaluation on the last stage: the loss of the output its forward kept,
  // without gradients; saved is released.
  CrossEntropyResult loss(StageSaved& saved, const Tensor& targets);
  // The last stage's logits of the output its forward kept (training never
  // forms them): the pipeline's keep-outputs diagnostic.
  Tensor logits(const StageSaved& saved);

  // ---- The whole model ----
  // One micro-batch: forward, loss and backward. The trainer passes grad_scale
  // = 1/tokens-in-the-step, so accumulation equals one large batch.
  CrossEntropyResult forward_backward(const Tensor& tokens, const Tensor& targets, float grad_scale,
                                      const AcPolicy& policy);
  // Loss only (evaluation): keeps no activations beyond the current block.
  CrossEntropyResult forward(const Tensor& tokens, const Tensor& targets);

  // Not owned; null: no hooks (a single process).
  void set_hooks(ParamGroupHooks* hooks) { hooks_ = hooks ? hooks : &no_hooks_; }

 private:
  Tensor backward_blocks(StageSaved& saved, Tensor dh);

  ModelArgs args_;
  int first_module_, end_module_;
  ParallelPlan single_process_;
  const ParallelPlan* plan_;
  ParamStore params_;
  RopeTable rope_;
  std::unique_ptr<TokenEmbedding> embedding_;  // null unless the stage holds module 0
  std::vector<TransformerBlock> blocks_;
  std::unique_ptr<OutputHead> head_;  // null unless the stage holds the last module
  ParamGroupHooks no_hooks_;
  ParamGroupHooks* hooks_ = &no_hooks_;
};

// The whole model's parameter list, with Hugging Face names, torchtitan's
// initialisation scales, and group = module index (0 the embedding, 1 + l
// block l, n_layers + 1 the final norm and output head).
std::vector<ParamSpec> llama_param_specs(const ModelArgs& args);
// The parameters of a stage, modules [first, end), their groups renumbered
// from 0. Throws anvil::Error for an empty or out-of-range slice, or a slice
// that splits tied embeddings from the head.
std::vector<ParamSpec> llama_param_specs(const ModelArgs& args, int first, int end);

}  // namespace anvil
