// Pipeline parallelism: one stage of the model (a contiguous slice of the
// module list) per pp rank, run by a schedule's program (pipeline_schedule.h).
// Boundary tensors travel between neighbouring stages: the forward output to
// the next stage, the input gradient back to the previous one. Sends are
// non-blocking and posted as soon as the tensor exists; receives block, and
// a valid program cannot wait on a receive nobody will send.
//
// Memory: a micro-batch's saved state (StageSaved) lives from its forward to
// its backward only, and the last stage computes the loss inside its backward
// with the fused head (no logits, no kept output afterwards) — so under 1F1B a
// stage holds at most its in-flight micro-batches, whatever the number of
// micro-batches (seed 000's bug kept every micro-batch's output to the end).
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "anvil/dist/comm.h"
#include "anvil/dist/pipeline_schedule.h"
#include "anvil/model/llama.h"

namespace anvil {

// How the module list is cut into contiguous stages (torchtitan's rule): the
// embedding counts as `first_stage_less_layers` blocks and the head as
// `last_stage_less_layers` (1 each by default: the first and last stage hold
// one block fewer), and the n_layers + those units spread as evenly as they
// go, the earlier stages taking the remainder.
struct PipelineSplit {
  int stages = 1;
  int first_stage_less_layers = 1, last_stage_less_layers = 1;
};
// Stage `stage` holds modules [first, end) of the module list. Throws
// anvil::Error, naming the keys, when the stages cannot all hold a block's
// worth or the first or last stage cannot hold what it is told to count.
std::pair<int, int> pipeline_stage_modules(const ModelArgs& args, const PipelineSplit& split, int stage);
// "stage 0: embedding, blocks 0-3; stage 1: blocks 4-5, head", for the banner.
std::string describe_pipeline_stages(const ModelArgs& args, const PipelineSplit& split);

// The whole model's flat fp32 buffer of a per-parameter state (master weights
// or an AdamW moment), laid out as a ParamStore of llama_param_specs(args), on
// pp rank 0, from every stage's buffer laid out as its stage's global
// parameters (llama_param_specs(args, first, end)). Collective over pp; the
// other ranks get an undefined tensor.
Tensor gather_pipeline_stages(Communicator& pp, const ModelArgs& args, const PipelineSplit& split,
                              const Tensor& stage_flat);

struct PipelineResult {
  double loss_sum = 0;     // over this step's micro-batches; the last stage's, 0 on the others
  int64_t loss_tokens = 0;
};

class PipelineStage {
 public:
  // model: this rank's stage (not owned); pp: the pipeline group, pp rank s
  // holding stage s.
  // keep_outputs: the last stage keeps every micro-batch's logits until the
  // step ends — torchtitan's behaviour before PyTorch #159251 (seed 000), a
  // diagnostic that shows what the fix saves.
  PipelineStage(Llama& model, Communicator& pp, bool keep_outputs = false);
  int stage() const { return stage_; }
  int num_stages() const { return stages_; }
  bool first() const { return stage_ == 0; }
  bool last() const { return stage_ == stages_ - 1; }

  // Runs this rank's actions for one step. tokens[i], targets[i]: micro-batch
  // i, (b, T) i32 (the first stage reads the tokens, the last the targets).
  // before_backward(i) runs before micro-batch i's backward (DDP's sync
  // switch). Parameter gradients accumulate into the model's.
  // Evaluation: tokens, targets (b, T) through the stages as one micro-batch,
  // forward only, nothing kept. The loss on the last stage, zero elsewhere.
  CrossEntropyResult evaluate(const Tensor& tokens, const Tensor& targets);

  PipelineResult run(const std::vector<PipeAction>& actions, const std::vector<Tensor>& tokens,
                     const std::vector<Tensor>& targets, float grad_scale, const AcPolicy& policy,
                     const std::function<void(int)>& before_backward = {});

 private:
  Tensor receive(int from_stage, int tag, int64_t B, int64_t T, const char* what);
  void send(const Tensor& t, int to_stage, int tag);
  void complete_sends(bool wait);

  Llama& model_;
  Communicator& pp_;
  int stage_, stages_;
  struct Send {
    Work work;
    Tensor buffer;  // kept alive until the send completes
  };
  std::vector<Send> sends_;
  bool keep_outputs_;
};

}  // namespace anvil
