#include "anvil/train/estimate.h"

#include <algorithm>
#include <map>
#include <tuple>
#include <utility>
#include <vector>

#include "anvil/core/device_pool.h"
#include "anvil/core/dry_run.h"
#include "anvil/core/error.h"
#include "anvil/estimate/flops.h"
#include "anvil/train/gpu_job.h"
#include "anvil/train/lr_schedule.h"
#include "anvil/train/parallelize.h"
#include "anvil/train/step_logger.h"
#include "anvil/train/train_step.h"

namespace anvil {

namespace {

// The save a run makes first: its checkpoint.interval-th step's, or the last
// step's when that comes first (which is model-only under last_save_model_only).
int64_t first_save_step(const JobConfig& cfg) { return std::min(cfg.checkpoint.interval, cfg.training.steps); }

}  // namespace

RankEstimate dry_run_rank(const JobConfig& cfg, const ModelArgs& args, int world_size, int rank,
                          std::vector<MemEvent>* step2, Device device) {
  if (!device.is_cpu()) check_gpu_job(args, world_size);
  ParallelDims par = resolve_parallel(cfg, args, world_size, rank);
  RankEstimate out;
  out.rank = rank;
  out.pp_rank = par.pp_rank;
  out.stages = par.pp_size > 1 ? par.pp_schedule.placement.stages_of(par.pp_rank) : std::vector<int>{0};
  DryRun dry(device.is_cpu() ? 0 : kDryRunGpuBytes);
  const ScopedDevice on(device);  // the model, its batches and every step's tensors, where the job runs
  TrackingAllocator& allocator = dry.allocator();
  if (world_size > 1) par.mesh = DeviceMesh::dry(par.layout, rank);
  // As train() does, in its order: the layout, the step's batches, then the steps.
  const DType dt = compute_dtype(cfg);
  const AcPolicy ac = activation_checkpoint_policy(cfg);
  ParallelizedModel layout(cfg, args, par, dt);
  out.data_parallel_bytes = layout.comm_bytes_closed_form();
  out.optimizer_bytes = layout.optimizer_bytes_per_step();
  out.optimizer_flops = layout.optimizer_flops_per_step();
  const LrSchedule lr = lr_schedule(cfg);
  const std::unique_ptr<Checkpointer> checkpointer = make_checkpointer(cfg);
  const MicroBatches batches = allocate_micro_batches(cfg, par.accum_steps, par.cp_size);
  // Between micro-batches the ranks agree on a stop (train/stop_signal.h): a
  // dry run never stops, but takes part in the agreement as every rank does.
  const StepContext ctx{
      cfg, par, layout, ac, lr, ForwardBackwardHooks{{}, [&par] { return par.max_over_world(0) != 0; }}, {}};
  const int64_t tokens = par.accum_steps * cfg.training.local_batch_size * cfg.training.seq_len / par.cp_size;
  release_caches();  // setup's one-off blocks, as the trainer
  allocator.reset_peak();     // the trainer's peaks start here (StepLogger::start)
  // The steps run, numbered as the trainer numbers them: the first; the first
  // save's (when checkpoints are on; else the second); and after an
  // asynchronous save that training outlives, the next, which runs beside the
  // save's copy (held until the next save).
  const int64_t save_step = first_save_step(cfg);
  std::vector<int64_t> as_steps = {1, std::max<int64_t>(2, save_step)};
  if (checkpointer && cfg.checkpoint.async_mode == "async" && save_step >= 2 && save_step < cfg.training.steps)
    as_steps.push_back(save_step + 1);
  for (size_t i = 0; i < as_steps.size(); ++i) {
    const int64_t as_step = as_steps[i], step = static_cast<int64_t>(i) + 1;
    if (step == 2 && step2) allocator.set_timeline(true);
    const StepOutcome s = run_train_step(ctx, batches, tokens, as_step);
    if (step == 2 && step2) {
      allocator.set_timeline(false);
      *step2 = allocator.timeline();
      allocator.clear_timeline();
    }
    if (step == 2) {
      out.tensor_parallel_bytes = static_cast<double>(s.comm.tp_bytes);
      out.pipeline_bytes = static_cast<double>(s.comm.pp_bytes);
      out.expert_parallel_bytes = static_cast<double>(s.comm.ep_bytes);
    }
    // The trainer logs the step (every rank's figures gathered over the world).
    if (as_step % cfg.metrics.log_freq == 0 || as_step == cfg.training.steps) {
      StepLog log;
      log.memory = allocator.stats();
      gather_rank_figures(par, log);
    }
    const bool one_off = validation_due(cfg, as_step) || checkpoint_due(cfg, as_step, checkpointer.get());
    release_after_step(layout, one_off);
    save_checkpoint_if_due(cfg, as_step, layout, checkpointer.get(), [] { return CheckpointMeta{}; });
    release_after_one_off(one_off);
  }
  if (checkpointer) checkpointer->wait();
  const MemStats stats = allocator.stats();
  out.memory.peak = stats.peak;
  out.memory.peak_total = stats.peak_total;
  out.memory.peak_reserved = stats.peak_reserved;
  if (DevicePool* gpu = dry.gpu_pool()) {
    const MemStats g = mem_stats(gpu->stats());
    out.device = device;
    out.device_memory.peak = g.peak;
    out.device_memory.peak_total = g.peak_total;
    out.device_memory.peak_reserved = g.peak_reserved;
  }
  return out;
}

LayoutEstimate estimate_layout(const JobConfig& cfg, const ModelArgs& args, int world_size, Device device) {
  if (!device.is_cpu()) check_gpu_job(args, world_size);
  LayoutEstimate est;
  est.par = resolve_parallel(cfg, args, world_size, 0);
  est.flops_per_token = flops_per_token(args, cfg.training.seq_len);
  const MeshLayout& layout = est.par.layout;
  // The roles: ranks differ by their pipeline rank (their stages), by
  // whether they write checkpoints (world rank 0) and, under expert
  // parallelism, by their rank in the expert group (which experts they hold,
  // and so the routed rows they receive: under forced-balanced routing the
  // first experts get one more row from each sequence whose routes do not
  // divide evenly). FSDP shards, tensor-parallel slices and data-parallel
  // replicas are the same size on every rank (both pad to a multiple of their
  // degree), so one rank of each role stands for all; except under Muon,
  // where a shard's runs of matrices and of the other parameters, and the
  // matrices the rank owns, differ from rank to rank: each is its own role.
  const bool muon = cfg.optimizer.name == "Muon";
  std::map<std::tuple<int, bool, int, int>, RankEstimate> roles;
  for (int rank = 0; rank < world_size; ++rank) {
    const int pp = world_size > 1 ? layout.group_rank(rank, MeshGroup::pp) : 0;
    const int ep = layout.ep() > 1 ? layout.group_rank(rank, MeshGroup::ep) : 0;
    const std::tuple<int, bool, int, int> role{pp, rank == 0, ep, muon ? rank : 0};
    auto it = roles.find(role);
    if (it == roles.end()) it = roles.emplace(role, dry_run_rank(cfg, args, world_size, rank, nullptr, device)).first;
    RankEstimate r = it->second;
    r.rank = rank;
    est.ranks.push_back(std::move(r));
  }
  return est;
}

}  // namespace anvil
