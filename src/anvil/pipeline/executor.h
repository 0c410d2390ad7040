// Pipeline parallelism: the model cut into stages (contiguous slices of the
// module list), one or several per pp rank as the schedule's placement says
// (pipeline/schedule.h), run by the schedule's program. Boundary tensors travel
// between neighbouring stages: the forward output to the next stage, the input
// gradient back to the previous one — by MPI between ranks, handed over in
// memory when both stages are on one rank (the V placement's turn). Sends are
// non-blocking and posted as soon as the tensor exists; the receive an action
// needs is posted as soon as the action before it is done, and a valid program
// cannot wait on a receive nobody will send.
//
// A send's buffer goes at a fixed point of the rank's program, never when the
// network happens to finish: at the first action whose input proves the
// receiver has taken it (a chain of messages from the receiving action on,
// send_release_points), or at the end of the pass. Waiting there cannot
// block, and the rank's memory is the same on every run, network or not —
// so the estimator's dry run (train/estimate.h) records what a real run holds.
//
// Memory: a micro-batch's saved state (StageSaved) lives from its forward to
// its backward only (to its W pass when the backward is split), and the stage
// holding the head computes the loss inside its backward with the fused head
// (no logits, no kept output afterwards) — so a stage holds at most the
// micro-batches its schedule keeps in flight, whatever the number of
// micro-batches (seed 000's bug kept every micro-batch's output to the end).
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "anvil/distributed/comm.h"
#include "anvil/model/llama.h"
#include "anvil/pipeline/schedule.h"
#include "anvil/pipeline/split.h"

namespace anvil {

// The whole model's flat fp32 buffer of a per-parameter state (master weights
// or an AdamW moment), laid out as a ParamStore of llama_param_specs(args), on
// pp rank 0, from every rank's buffer laid out as its stages' global
// parameters (llama_param_specs(args, pipeline_rank_modules(...))). Collective
// over pp; the other ranks get an undefined tensor.
Tensor gather_pipeline_stages(Communicator& pp, const ModelArgs& args, const PipelineSplit& split,
                              const PipePlacement& placement, const Tensor& rank_flat);

// For each action of `rank`'s program that sends a tensor to another rank,
// the index of its first later action whose inputs prove the receiver has
// taken the tensor (happens-before over the schedule's messages and the
// ranks' program order); -1 for the others and where no action proves it
// (the buffer then waits for the pass's end).
std::vector<int> send_release_points(const PipeSchedule& schedule, int rank);

struct PipelineResult {
  double loss_sum = 0;  // over this step's micro-batches; the head's rank's, 0 on the others
  int64_t loss_tokens = 0;
};

class PipelineExecutor {
 public:
  // model: this rank's stages (not owned), those the schedule's placement
  // puts on pp rank pp.rank(), in ascending order; the rank runs its row of
  // the schedule's program each pass.
  // keep_outputs: the head's stage keeps every micro-batch's logits until the
  // step ends — torchtitan's behaviour before PyTorch #159251 (seed 000), a
  // diagnostic that shows what the fix saves.
  PipelineExecutor(Llama& model, Communicator& pp, const PipeSchedule& schedule, bool keep_outputs = false);

  // Runs this rank's actions for one pass. tokens[i], targets[i]: micro-batch
  // i, (b, T) i32 (the first stage reads the tokens, the last the targets).
  // before_backward(i) runs before each of micro-batch i's backward actions
  // (B, I and W: DDP's sync switch). Parameter gradients accumulate into the
  // model's. documents[i]: micro-batch i's document bounds for block-causal
  // attention (every stage reads them); empty: causal.
  PipelineResult run(const std::vector<Tensor>& tokens, const std::vector<Tensor>& targets, float grad_scale,
                     const AcPolicy& policy, const std::function<void(int)>& before_backward = {},
                     const std::vector<Tensor>& documents = {});
  // Evaluation: tokens, targets (b, T) through the stages as one micro-batch,
  // forward only, nothing kept. The loss on the head's rank, zero elsewhere.
  CrossEntropyResult evaluate(const Tensor& tokens, const Tensor& targets, const Tensor& documents = {});

 private:
  enum class Flow { activation, gradient };
  // The boundary tensor `flow` of micro-batch i into stage `to` (from stage
  // to − 1 for an activation, to + 1 for a gradient).
  int tag(Flow flow, int to, int micro_batch) const;
  bool on_this_rank(int stage) const { return placement_.rank_of(stage) == rank_; }
  int local(int stage) const;  // the model's index of a stage this rank holds
  void post_receive(Flow flow, int to, int micro_batch, int64_t B, int64_t T);
  Tensor take_input(Flow flow, int to, int micro_batch, int64_t B, int64_t T);
  void hand_over(const Tensor& t, Flow flow, int to, int micro_batch, int release_at);
  // Waits for, and frees, the sends whose release point is action k (every send, k = -1).
  void release_sends(int k);
  // Posts the receive action `a` needs, if any and not yet posted.
  void post_receive_for(const PipeAction& a, const std::vector<Tensor>& tokens);
  // One action of a pass (run's loop body).
  struct Pass;
  void run_action(size_t k, Pass& pass);

  Llama& model_;
  Communicator& pp_;
  PipePlacement placement_;
  int rank_;
  std::vector<int> stages_;  // the global stages this rank holds, ascending
  std::vector<PipeAction> actions_;   // this rank's row of the program
  std::vector<const char*> labels_;   // each action's trace span name ("pipeline.1F3")
  bool keep_outputs_;
  std::vector<int> release_at_;  // per action: send_release_points
  struct Send {
    Work work;
    int release_at;  // the action at which it goes; -1: the pass's end
  };
  std::vector<Send> sends_;
  struct Inbox {
    Tensor tensor;
    Work work;  // pending when the tensor is still arriving
  };
  std::map<int, Inbox> inbox_;  // by tag: received, arriving, or handed over on this rank
};

}  // namespace anvil
