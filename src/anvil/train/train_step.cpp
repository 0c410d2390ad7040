#include "anvil/train/train_step.h"

#include <cmath>
#include <cstdio>
#include <filesystem>

#include "anvil/core/allocator.h"
#include "anvil/core/dry_run.h"
#include "anvil/core/error.h"
#include "anvil/core/profiler.h"
#include "anvil/ops/grad_norm.h"

namespace anvil {

namespace {

// A non-finite loss or gradient norm stops the run with an error, or, with
// training.skip_nonfinite_steps, skips the step (returns true).
bool skip_nonfinite_step(const JobConfig& cfg, int64_t step, double loss, double grad_norm) {
  // A dry run's values mean nothing (a pipeline rank without the head sums
  // no loss from the others): its optimizer always runs, as a real step's does.
  if (dry_run() || (std::isfinite(loss) && std::isfinite(grad_norm))) return false;
  if (!cfg.training.skip_nonfinite_steps)
    throw Error(detail::concat("step ", step, ": the ", std::isfinite(loss) ? "gradient norm" : "loss",
                               " is not finite (loss ", loss, ", grad_norm ", grad_norm,
                               "); lower optimizer.lr, keep training.max_norm > 0, or set "
                               "training.skip_nonfinite_steps = true to skip such steps"));
  std::printf("anvil: step %lld skipped: loss %g, grad_norm %g are not finite\n", static_cast<long long>(step), loss,
              grad_norm);
  return true;
}

// The factor the gradients are scaled by: clipping to training.max_norm (0: none).
float clip_factor(const JobConfig& cfg, double grad_norm) {
  return cfg.training.max_norm > 0 ? static_cast<float>(clip_coefficient(grad_norm, cfg.training.max_norm)) : 1.0f;
}

}  // namespace

LrSchedule lr_schedule(const JobConfig& cfg) {
  return LrSchedule{cfg.optimizer.lr,           cfg.training.steps,           cfg.lr_scheduler.warmup_steps,
                    cfg.lr_scheduler.decay_ratio, cfg.lr_scheduler.decay_type, cfg.lr_scheduler.min_lr_factor};
}

MicroBatches allocate_micro_batches(const JobConfig& cfg, int64_t micro_batches, int cp) {
  const auto& tc = cfg.training;
  // Under context parallelism the model takes this rank's 2 chunks of every
  // sequence as rows of their own; the loader fills whole sequences first.
  const int64_t rows = cp > 1 ? 2 * tc.local_batch_size : tc.local_batch_size,
                cols = tc.seq_len / (cp > 1 ? 2 * cp : 1);
  MicroBatches batches;
  const ScopedDevice host(Device::cpu());  // the loader fills them; the step copies them where the model runs
  for (int64_t i = 0; i < micro_batches; ++i) {
    batches.tokens.push_back(Tensor::empty({rows, cols}, DType::i32, MemCategory::workspace, "batch.tokens"));
    batches.targets.push_back(Tensor::empty({rows, cols}, DType::i32, MemCategory::workspace, "batch.targets"));
    // Block-causal attention: the whole sequences' document bounds, which every cp rank reads whole.
    if (cfg.model.attn_mask_type == "block_causal")
      batches.documents.push_back(Tensor::empty({tc.local_batch_size, 2, tc.seq_len}, DType::i32,
                                                MemCategory::workspace, "batch.documents"));
  }
  if (cp > 1) {
    batches.loaded_tokens =
        Tensor::empty({tc.local_batch_size, tc.seq_len}, DType::i32, MemCategory::workspace, "batch.loaded_tokens");
    batches.loaded_targets =
        Tensor::empty({tc.local_batch_size, tc.seq_len}, DType::i32, MemCategory::workspace, "batch.loaded_targets");
  }
  return batches;
}

StepOutcome run_train_step(const StepContext& ctx, const MicroBatches& batches, int64_t step_tokens, int64_t step) {
  const ParallelDims& par = ctx.par;
  ParallelizedModel& layout = ctx.layout;
  StepOutcome out;
  layout.begin_step();
  // Every data-parallel (and context-parallel) rank sees as many tokens; the
  // gradients are summed over the ranks, so each scales by the whole step's count.
  const float grad_scale = 1.0f / static_cast<float>(step_tokens * par.dp_size * par.cp_size);
  out.run = layout.forward_backward(batches, grad_scale, ctx.ac, ctx.hooks);
  if (ctx.after_forward_backward) ctx.after_forward_backward();
  layout.finish_backward();
  out.comm = layout.take_comm_stats();
  sum_loss_over_dp(par, out.run.loss_sum, out.run.loss_tokens);
  if (out.run.stopped_after > 0) {
    out.end = StepOutcome::End::stopped;
    return out;
  }
  out.loss = out.run.loss_sum / static_cast<double>(out.run.loss_tokens);
  const ScopedPhase phase(SpanCategory::optimizer, "optimizer");
  out.grad_norm = layout.grad_norm();
  out.lr = ctx.lr_schedule.at(step);
  if (skip_nonfinite_step(ctx.cfg, step, out.loss, out.grad_norm)) {
    out.end = StepOutcome::End::skipped;
    return out;
  }
  layout.optimizer_step(ctx.lr_schedule.factor(step), step, clip_factor(ctx.cfg, out.grad_norm));
  out.comm.optimizer_bytes = layout.take_optimizer_comm_bytes();
  layout.update_expert_bias(out.run.moe);
  return out;
}

bool validation_due(const JobConfig& cfg, int64_t step) {
  return cfg.validation.enable && step % cfg.validation.freq == 0;
}

bool checkpoint_due(const JobConfig& cfg, int64_t step, const Checkpointer* checkpointer) {
  return checkpointer != nullptr && (step % cfg.checkpoint.interval == 0 || step == cfg.training.steps);
}

void release_after_step(ParallelizedModel& layout, bool one_off_follows) {
  TrackingAllocator& allocator = TrackingAllocator::instance();
  allocator.trim_cache();
  if (!one_off_follows) return;
  layout.release_grads();
  release_caches();
}

void release_caches() {
  TrackingAllocator::instance().release_cache();
  empty_device_caches();
}

void release_after_one_off(bool one_off_ran) {
  if (one_off_ran) release_caches();
}

std::unique_ptr<Checkpointer> make_checkpointer(const JobConfig& cfg) {
  if (!cfg.checkpoint.enable) return nullptr;
  return std::make_unique<Checkpointer>((std::filesystem::path(cfg.job.dump_folder) / cfg.checkpoint.folder).string(),
                                        cfg.checkpoint.keep_latest_k, cfg.checkpoint.async_mode == "async");
}

void save_checkpoint_if_due(const JobConfig& cfg, int64_t step, ParallelizedModel& layout, Checkpointer* checkpointer,
                            const std::function<CheckpointMeta()>& meta) {
  const bool last = step == cfg.training.steps;
  if (!checkpoint_due(cfg, step, checkpointer)) return;
  const bool model_only = last && cfg.checkpoint.last_save_model_only;
  const DType model_dtype = model_only && cfg.checkpoint.export_dtype == "bfloat16" ? DType::bf16 : DType::f32;
  layout.save_checkpoint(*checkpointer, step, model_only, model_dtype, meta);
}

}  // namespace anvil
