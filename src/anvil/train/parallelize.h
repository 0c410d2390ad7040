// The job's layout, built once (torchtitan's parallelize_llama): the model
// with tensor parallelism applied, FSDP/HSDP or DDP attached through its
// parameter-group hooks, and everything else that depends on the layout —
// which weights the optimizer (train/optimizer.h) updates, the gradient norm over the ranks,
// checkpoint saves and loads, and loading global weights into any layout (the
// last three through one RankStateLayout, train/state_layout.h).
// The trainer drives a step through it without knowing which layout it is.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>

#include "anvil/core/tensor.h"
#include "anvil/distributed/comm_tracker.h"
#include "anvil/model/args.h"
#include "anvil/model/params.h"
#include "anvil/ops/adamw.h"
#include "anvil/train/checkpoint.h"
#include "anvil/train/config.h"
#include "anvil/train/forward_backward.h"
#include "anvil/train/optimizer.h"
#include "anvil/train/parallel_dims.h"
#include "anvil/train/state_layout.h"

namespace anvil {

class Llama;
class FsdpParams;
class DdpGradSync;
class TensorParallelStyle;
class ContextParallel;
class ParallelStyle;
class PipelineExecutor;
class ExpertExchange;

// This rank's communication since the last take.
struct StepComm {
  CommStats data_parallel;  // FSDP's or DDP's collectives (gradients, weights)
  uint64_t tp_bytes = 0;    // tensor-parallel collectives (activations), counted by the tp communicator
  uint64_t pp_bytes = 0;    // over the pp group: boundary tensors and their gradients, loss and norm sums
  uint64_t ep_bytes = 0;    // expert parallelism's all-to-alls over the dp group: routed rows, their gradients, counts
  uint64_t optimizer_bytes = 0;  // Muon's all-to-alls over a shard group: matrices to their owners and back (set
                                 // after the optimizer step: take_optimizer_comm_bytes)
};

// A loss sum and its token count summed over the data-parallel ranks (as f32,
// enough for a loss; a single process's are left as they are).
void sum_loss_over_dp(const ParallelDims& par, double& loss_sum, int64_t& tokens);

class ParallelizedModel {
 public:
  // Builds the model for this rank's place in `par` and initialises its
  // weights from training.seed (the global model's, whatever the layout).
  ParallelizedModel(const JobConfig& cfg, const ModelArgs& args, const ParallelDims& par, DType compute_dtype);
  ~ParallelizedModel();
  ParallelizedModel(const ParallelizedModel&) = delete;
  ParallelizedModel& operator=(const ParallelizedModel&) = delete;

  Llama& model() { return *model_; }
  // What the data-parallel layout should send per rank per step, in closed
  // form (0 for a single process), and its console line (distributed runs).
  double comm_bytes_closed_form() const { return comm_closed_form_; }
  void print_comm_closed_form() const;

  // Weights read as global tensors by `read` (a checkpoint's or a Hugging
  // Face folder's) into this rank's layout.
  void load_global_weights(const std::function<void(ParamStore&)>& read);
  // Resumes from checkpoint `step`: weights and the optimizer state (created here),
  // global tensors sliced to this rank. Returns the checkpoint's state.json.
  nlohmann::json load_checkpoint(const Checkpointer& checkpointer, int64_t step);
  // Saves checkpoint `step` as global tensors: every rank takes part in the
  // gathers, rank 0 writes. model_only: the weights alone, in model_dtype.
  void save_checkpoint(Checkpointer& checkpointer, int64_t step, bool model_only, DType model_dtype,
                       const std::function<CheckpointMeta()>& meta);

  // The step, in order: begin_step, forward_backward, finish_backward, grad_norm,
  // optimizer_step, release_grads.
  void begin_step();  // drops gradients a skipped or interrupted step left
  // The step's micro-batches forward and backward: one after another through
  // the whole model, or through the pipeline's schedule (each micro-batch cut
  // into pp_micro_batches). The
  // loss returned is the whole model's on every rank.
  ForwardBackwardResult forward_backward(const MicroBatches& batches, float grad_scale, const AcPolicy& policy,
                                         const ForwardBackwardHooks& hooks);
  // The loss of one micro-batch, forward only, on every rank.
  CrossEntropyResult evaluate(const Tensor& tokens, const Tensor& targets, const Tensor& documents = {});
  void finish_backward();  // waits for the gradient reductions in flight
  // The global gradient norm (every element of the global gradient counted once).
  double grad_norm();
  // The job's optimizer (optimizer.name) on this rank's master weights (the
  // model's, or its FSDP shard), its gradients scaled by clip, every learning
  // rate times the schedule's lr_factor; the state is created at the first
  // call, as in PyTorch, so the first step's forward and backward run without it.
  void optimizer_step(double lr_factor, int64_t step, float clip);
  // After the optimizer step: a MoE's auxiliary-loss-free balance moves its
  // expert biases by the step's routes (Llama::update_expert_bias).
  void update_expert_bias(const MoeReport& moe);
  // What the model keeps but does not train, for checkpoints: a MoE's expert
  // biases ({"expert_bias": (n_layers·E)}), or null; and its restore.
  nlohmann::json model_state() const;
  void load_model_state(const nlohmann::json& state);
  void release_grads();
  StepComm take_comm_stats();
  // The bytes the optimizer's own collectives sent since the last take (Muon's, under FSDP).
  uint64_t take_optimizer_comm_bytes();
  // Per step on this rank: the optimizer's Newton-Schulz FLOPs and the bytes
  // its all-to-alls send (Muon; zero under AdamW), from the layout.
  double optimizer_flops_per_step() const;
  double optimizer_bytes_per_step() const;

 private:
  // The gradients this rank's optimizer updates.
  Tensor& grads();
  // The fp32 weights this rank's optimizer updates (its FSDP shard, or the
  // model's), and their compute copy brought up to date after a load.
  Tensor& master();
  void sync_compute_copy();
  void before_micro_batch(int64_t i, int64_t n);
  // A mixture-of-experts model's step: its routing statistics cleared and the
  // auxiliary loss's scale set from the step's sequences; then its report.
  void begin_moe_step(const MicroBatches& batches);
  MoeReport moe_report();
  // The last stage's loss sum and token count, summed over the pp group (as f32, as over dp).
  void sum_loss_over_pp(double& loss_sum, int64_t& tokens);

  const JobConfig& cfg_;
  ModelArgs args_;
  const ParallelDims& par_;
  DType compute_dtype_;
  std::unique_ptr<TensorParallelStyle> tp_;
  // Under context parallelism: this rank's chunks and their attention, and the
  // style that carries it when there is no tensor parallelism.
  std::unique_ptr<ContextParallel> cp_;
  std::unique_ptr<ParallelStyle> plain_style_;
  std::unique_ptr<ExpertExchange> experts_;  // expert parallelism's exchange over the dp group
  std::unique_ptr<Llama> model_;
  std::unique_ptr<FsdpParams> fsdp_;
  std::unique_ptr<DdpGradSync> ddp_;
  std::unique_ptr<PipelineExecutor> pipeline_;  // null without pipeline parallelism
  double comm_closed_form_ = 0;
  bool hold_gathered_ = false;  // FSDP keeps the gathered weights for the step (under PP)
  // Where this rank's weights, gradients and moments sit in the whole
  // model's: for checkpoints, global weights and the gradient norm.
  std::unique_ptr<RankStateLayout> state_layout_;
  std::unique_ptr<RankOptimizer> optimizer_;  // over the model's weights or its FSDP shard
};

}  // namespace anvil
