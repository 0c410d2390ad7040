// A step's forward and backward without pipeline parallelism: the step's
// micro-batches run one after another through the whole model on this rank —
// forward, loss and backward for each, the gradients accumulating
// (torchtitan's forward_backward_step per micro-batch). With pipeline
// parallelism the layout runs them through the pipeline's schedule instead
// (pipeline/executor.h), with the same inputs and result.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "anvil/core/tensor.h"
#include "anvil/model/llama.h"

namespace anvil {

// A step's micro-batches: tokens[i], targets[i] (B, T) i32; under
// block-causal attention documents[i], their whole sequences' document bounds
// (B, 2, T) i32 (ops/document_mask.h; T the whole sequence length under
// context parallelism), else empty.
struct MicroBatches {
  std::vector<Tensor> tokens, targets, documents;
  // documents[i], or undefined (causal).
  Tensor documents_of(size_t i) const { return i < documents.size() ? documents[i] : Tensor(); }
  // Under context parallelism: the whole sequences the loader fills, before
  // this rank keeps its chunks of them in tokens and targets.
  Tensor loaded_tokens, loaded_targets;
  int64_t size() const { return static_cast<int64_t>(tokens.size()); }
};

// A mixture-of-experts model's step, over every rank: the routes each expert
// of each layer took, and the load-balancing loss's mean over the layers and
// the step's sequences (before its coefficient; not in the loss above).
struct MoeReport {
  int64_t num_experts = 0;    // 0: a dense model
  std::vector<double> routes;  // (n_layers, num_experts)
  double aux_loss = 0;
  // This rank's own (not summed): MoeStepState's received_rows and received_share.
  int64_t received_rows = 0;
  double received_share = 0;
};

struct ForwardBackwardResult {
  double loss_sum = 0;      // over the micro-batches that ran
  int64_t loss_tokens = 0;  // the targets that carried loss
  // Micro-batches done when a stop was agreed; 0 when the step ran to its end
  // without one.
  int64_t stopped_after = 0;
  MoeReport moe;  // filled by the layout (ParallelizedModel)
};

struct ForwardBackwardHooks {
  // Called before micro-batch i of n runs (the layout's per-micro-batch
  // control: DDP synchronises only on the last). May be empty.
  std::function<void(int64_t i, int64_t n)> before_micro_batch;
  // Asked after every micro-batch; true stops the step there. It is
  // collective under MPI (the ranks agree), so every rank asks it equally often.
  std::function<bool()> stop_requested;
};

// Runs `batches` through `model`: forward, loss and backward per micro-batch,
// the parameter gradients scaled by grad_scale (1 / the step's tokens over
// all data-parallel ranks, so accumulation equals one large batch).
ForwardBackwardResult forward_backward_single_stage(Llama& model, const MicroBatches& batches, float grad_scale,
                                                    const AcPolicy& policy, const ForwardBackwardHooks& hooks);

// The loss of one micro-batch, forward only (evaluation): no gradients, no
// activations kept beyond the running block.
CrossEntropyResult evaluate_single_stage(Llama& model, const Tensor& tokens, const Tensor& targets,
                                         const Tensor& documents = {});

}  // namespace anvil
