// One training step as every rank runs it, and what the trainer does with
// memory between steps. The trainer's loop (train/trainer.cpp) and the
// estimator's dry run (train/estimate.h) both call these, so the estimate is
// the step's own allocations, not a description of them.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>

#include "anvil/model/activation_checkpoint.h"
#include "anvil/train/checkpoint.h"
#include "anvil/train/config.h"
#include "anvil/train/forward_backward.h"
#include "anvil/train/lr_schedule.h"
#include "anvil/train/parallel_dims.h"
#include "anvil/train/parallelize.h"

namespace anvil {

// The [lr_scheduler] keys as the learning-rate schedule (of optimizer.lr; every
// learning rate takes its factor).
LrSchedule lr_schedule(const JobConfig& cfg);

// The step's micro-batch buffers (tokens and targets, (local_batch_size,
// seq_len) i32 each, in host memory), made once and refilled every step; under context
// parallelism (cp > 1) this rank's chunks, (2·local_batch_size, seq_len /
// (2·cp)), and one pair of whole-sequence buffers the loader fills.
MicroBatches allocate_micro_batches(const JobConfig& cfg, int64_t micro_batches, int cp = 1);

struct StepOutcome {
  enum class End {
    done,     // the optimizer ran
    stopped,  // a stop was agreed inside the step: its gradients are dropped
    skipped,  // a non-finite loss or norm under training.skip_nonfinite_steps
  };
  End end = End::done;
  ForwardBackwardResult run;  // loss and tokens summed over the data-parallel ranks
  StepComm comm;       // this rank's communication of the step
  double loss = 0, grad_norm = 0, lr = 0;
};

// What a step needs besides its batches.
struct StepContext {
  const JobConfig& cfg;
  const ParallelDims& par;
  ParallelizedModel& layout;
  const AcPolicy& ac;
  const LrSchedule& lr_schedule;
  ForwardBackwardHooks hooks;                    // the stop signal's agreement, asked between micro-batches
  std::function<void()> after_forward_backward;  // a test hook (a rank dying mid-step); may be empty
};

// Step `step` on `batches`, which hold `step_tokens` of this rank's tokens:
// forward and backward (forward, loss, backward of every micro-batch), the gradient
// reductions, the loss over the ranks, the gradient norm, clipping and the optimizer.
// A non-finite loss or norm throws, or skips the step under
// training.skip_nonfinite_steps. (In a dry run the loss is 0 over every
// target and the norm 0, both finite: the optimizer always runs.)
StepOutcome run_train_step(const StepContext& ctx, const MicroBatches& batches, int64_t step_tokens, int64_t step);

// Validation or a checkpoint save follows step `step`: work done once, which
// needs neither the gradients nor the step's cached blocks.
bool validation_due(const JobConfig& cfg, int64_t step);
bool checkpoint_due(const JobConfig& cfg, int64_t step, const Checkpointer* checkpointer);

// After a step: its blocks stay cached for the next step (those of sizes it
// did not ask for go back to the kernel), but before one-off work the
// gradients (begin_step zeroes them otherwise) and every cached block go, so
// neither stacks on that work's own peak. After the one-off work, its blocks
// go back too (release_after_one_off).
void release_after_step(ParallelizedModel& layout, bool one_off_follows);
// The host's block cache and every device pool's free segments, back to the
// system: after setup's one-off tensors and around one-off work.
void release_caches();
void release_after_one_off(bool one_off_ran);

// checkpoint.folder under the dump folder, or null when checkpoints are off.
std::unique_ptr<Checkpointer> make_checkpointer(const JobConfig& cfg);
// Saves checkpoint `step` when it is due: model-only in export_dtype for the
// last step under checkpoint.last_save_model_only, else weights and the optimizer state.
void save_checkpoint_if_due(const JobConfig& cfg, int64_t step, ParallelizedModel& layout, Checkpointer* checkpointer,
                            const std::function<CheckpointMeta()>& meta);

}  // namespace anvil
