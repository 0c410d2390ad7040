#include "anvil/train/layout_estimate.h"

#include <algorithm>
#include <deque>
#include <map>
#include <tuple>
#include <utility>

#include "anvil/core/error.h"
#include "anvil/dist/comm.h"
#include "anvil/dist/comm_volume.h"
#include "anvil/dist/fsdp.h"
#include "anvil/dist/pipeline.h"
#include "anvil/dist/tensor_parallel.h"
#include "anvil/model/llama.h"
#include "anvil/plan/flops.h"
#include "anvil/plan/memory_sim.h"

namespace anvil {

namespace {

using Buf = MemSim::Buf;

// FsdpParams (dist/fsdp.cpp) in the replay: the gathered compute weights of a
// group (communication) from before its use to after it, the next group's
// prefetched beside them; the full fp32 gradients of a group (gradients) from
// its backward until their reduce-scatter completes, at most two in flight.
class FsdpSim : public GroupHooksSim {
 public:
  FsdpSim(MemSim& sim, std::vector<ParamGroup> groups, int n, size_t compute_bytes, ReshardPolicy reshard,
          bool hold_for_step)
      : sim_(sim), groups_(std::move(groups)), n_(n), e_(compute_bytes), reshard_(reshard), hold_(hold_for_step) {
    for (const ParamGroup& g : groups_) shard_.push_back(static_cast<size_t>(fsdp_shard_numel(g.numel, n)));
    gathered_.resize(groups_.size());
    full_grads_.resize(groups_.size());
    open_.assign(groups_.size(), 0);
  }
  size_t shard_total() const {
    size_t t = 0;
    for (size_t s : shard_) t += s;
    return t;
  }
  void before_forward(int g) override {
    gather(g);
    if (g + 1 < static_cast<int>(groups_.size())) gather(g + 1);
  }
  void after_forward(int g) override {
    if (!hold_ && !fsdp_keep_after_forward(groups_, g, reshard_)) gathered_[static_cast<size_t>(g)] = nullptr;
  }
  void before_backward(int g) override {
    const auto i = static_cast<size_t>(g);
    gather(g);
    if (!full_grads_[i]) full_grads_[i] = sim_.alloc(MemCategory::gradients, static_cast<size_t>(n_) * shard_[i] * 4);
    ++open_[i];
    if (g > 0) gather(g - 1);
  }
  void after_backward(int g) override {
    const auto i = static_cast<size_t>(g);
    if (--open_[i] > 0) return;
    Buf full = std::move(full_grads_[i]);
    if (!hold_) gathered_[i] = nullptr;
    // The f32 partial, then the pieces the other ranks send (dist/comm.cpp's ireduce_scatter).
    Buf partial = sim_.alloc(MemCategory::communication, shard_[i] * 4);
    Buf pieces = sim_.alloc(MemCategory::communication, static_cast<size_t>(n_) * shard_[i] * 4);
    reducing_.push_back({std::move(full), std::move(partial), std::move(pieces)});
    while (reducing_.size() > 2) reducing_.pop_front();
  }
  void finish() {
    if (hold_)
      for (Buf& b : gathered_) b = nullptr;
    reducing_.clear();
  }

 private:
  void gather(int g) {
    const auto i = static_cast<size_t>(g);
    if (!gathered_[i]) gathered_[i] = sim_.alloc(MemCategory::communication, static_cast<size_t>(n_) * shard_[i] * e_);
  }
  MemSim& sim_;
  std::vector<ParamGroup> groups_;
  int n_;
  size_t e_;
  ReshardPolicy reshard_;
  bool hold_;
  std::vector<size_t> shard_;
  std::vector<Buf> gathered_, full_grads_;
  std::vector<int> open_;
  struct Reducing {
    Buf full, partial, pieces;
  };
  std::deque<Reducing> reducing_;
};

// PipelineStage::run (dist/pipeline.cpp) in the replay: this rank's actions in
// order, each receive's buffer posted when the action before it is done (or
// as it starts), a sent tensor copied to a communication buffer that lives
// until the next send (by when MPI has delivered it: the receiver posted its
// receive before it could wait), a same-rank hand-over held until taken.
class PipelineSim {
 public:
  PipelineSim(MemSim& sim, ModelSim& model, const PipeSchedule& schedule, int pp_rank, bool keep_outputs)
      : sim_(sim),
        model_(model),
        placement_(schedule.placement),
        actions_(schedule.program[static_cast<size_t>(pp_rank)]),
        rank_(pp_rank),
        stages_(schedule.placement.stages_of(pp_rank)),
        keep_outputs_(keep_outputs) {}

  double bytes_sent = 0, bytes_received = 0;

  void run() {
    for (size_t k = 0; k < actions_.size(); ++k) {
      run_action(actions_[k]);
      if (k + 1 < actions_.size()) post_receive_for(actions_[k + 1]);
    }
    sends_.clear();
    kept_.clear();
  }

 private:
  enum class Flow { activation, gradient };
  using Key = std::tuple<Flow, int, int>;  // flow, receiving stage, micro-batch

  int local(int stage) const {
    return static_cast<int>(std::find(stages_.begin(), stages_.end(), stage) - stages_.begin());
  }
  bool on_this_rank(int stage) const { return placement_.rank_of(stage) == rank_; }

  void post_receive(Flow flow, int to, int micro_batch) {
    const int from = flow == Flow::activation ? to - 1 : to + 1;
    const Key key{flow, to, micro_batch};
    if (on_this_rank(from) || inbox_.count(key)) return;
    inbox_[key] = sim_.act(model_.residual_bytes());
    bytes_received += static_cast<double>(model_.residual_bytes());
  }
  Buf take_input(Flow flow, int to, int micro_batch) {
    post_receive(flow, to, micro_batch);
    const auto it = inbox_.find({flow, to, micro_batch});
    ANVIL_ASSERT(it != inbox_.end(), "the replay of pp rank ", rank_, " takes a tensor it never received");
    Buf out = std::move(it->second);
    inbox_.erase(it);
    return out;
  }
  void hand_over(const Buf& t, Flow flow, int to, int micro_batch) {
    if (on_this_rank(to)) {
      inbox_[{flow, to, micro_batch}] = t;
      return;
    }
    Buf copy = sim_.alloc(MemCategory::communication, model_.residual_bytes());
    bytes_sent += static_cast<double>(model_.residual_bytes());
    sends_.clear();  // the earlier sends are complete
    sends_.push_back(std::move(copy));
  }
  void post_receive_for(const PipeAction& a) {
    if (a.op == PipeOp::forward && a.stage > 0) post_receive(Flow::activation, a.stage, a.micro_batch);
    if ((a.op == PipeOp::backward || a.op == PipeOp::backward_input) && a.stage < placement_.stages() - 1)
      post_receive(Flow::gradient, a.stage, a.micro_batch);
  }
  void run_action(const PipeAction& a) {
    const int S = placement_.stages(), l = local(a.stage), i = a.micro_batch;
    if (a.op == PipeOp::forward) {
      const Buf input = a.stage == 0 ? nullptr : take_input(Flow::activation, a.stage, i);
      SimStageSaved& saved = in_flight_[{a.stage, i}];
      const Buf out = model_.forward(l, input, saved);
      if (a.stage < S - 1) hand_over(out, Flow::activation, a.stage + 1, i);
      else if (keep_outputs_) kept_.push_back(model_.logits(saved));
      return;
    }
    const auto saved = in_flight_.find({a.stage, i});
    ANVIL_ASSERT(saved != in_flight_.end(), "the replay of pp rank ", rank_, " runs a backward before its forward");
    if (a.op == PipeOp::backward_weight) {
      model_.backward_weight(l, saved->second);
      in_flight_.erase(saved);
      return;
    }
    const bool split = a.op == PipeOp::backward_input;
    Buf d_input = a.stage == S - 1
                      ? model_.backward_from_loss(l, saved->second, split)
                      : model_.backward(l, saved->second, take_input(Flow::gradient, a.stage, i), split);
    if (!split) in_flight_.erase(saved);
    if (a.stage > 0) hand_over(d_input, Flow::gradient, a.stage - 1, i);
  }

  MemSim& sim_;
  ModelSim& model_;
  const PipePlacement& placement_;
  const std::vector<PipeAction>& actions_;
  int rank_;
  std::vector<int> stages_;
  bool keep_outputs_;
  std::map<Key, Buf> inbox_;
  std::map<std::pair<int, int>, SimStageSaved> in_flight_;
  std::vector<Buf> sends_, kept_;
};

// One pp rank's run: two training steps (the first creates AdamW's moments
// after its backward, as the trainer does) and a checkpoint save.
// world_rank0: world rank 0, which writes checkpoints (and stages an
// asynchronous save's copy).
RankEstimate simulate_rank(const JobConfig& cfg, const ModelArgs& args, const Parallel& par, int pp_rank,
                           bool world_rank0) {
  const auto& p = cfg.parallelism;
  const DType dt = compute_dtype(cfg);
  const AcPolicy ac = activation_checkpoint_policy(cfg);
  const bool fsdp = par.mode == DataParallelMode::fsdp, pipeline = par.pp_size > 1;
  const int tp = par.tp_size;
  const std::vector<ModuleRange> stages =
      pipeline ? pipeline_rank_modules(args, par.pp_split, par.pp_schedule.placement, pp_rank)
               : std::vector<ModuleRange>{{0, llama_num_modules(args)}};
  const std::vector<ParamSpec> stage_specs = llama_param_specs(args, stages);
  const ParamStore local(tensor_parallel_param_specs(stage_specs, tp, 0), dt, /*allocate=*/false);
  const size_t e = dtype_size(dt);

  MemSim sim;
  const ReshardPolicy reshard = parse_reshard_policy(p.fsdp_reshard_after_forward);
  const bool hold_gathered = pipeline && reshard == ReshardPolicy::default_policy;
  FsdpSim fsdp_sim(sim, local.groups(), fsdp ? par.layout.dp_shard() : 1, e, reshard, hold_gathered);
  // What this rank's optimizer updates: the whole local model, or its FSDP shard.
  const size_t owned = fsdp ? fsdp_sim.shard_total() : static_cast<size_t>(local.numel());
  sim.hold(MemCategory::parameters, owned * 4);                       // fp32 master weights
  if (dt == DType::bf16) sim.hold(MemCategory::parameters, owned * 2);  // their bf16 compute copy
  const TrainShape step_shape{cfg.training.local_batch_size, cfg.training.seq_len, dt, ac, par.accum_steps};
  sim.hold(MemCategory::workspace, step_workspace_bytes(args, step_shape));  // RoPE table, token batches
  {  // the widened bf16 products' f32 buffers, kept from the first step on
    TrainShape mb = step_shape;
    mb.local_batch_size = pipeline ? p.pipeline_parallel_microbatch_size : cfg.training.local_batch_size;
    const bool with_head = std::any_of(stages.begin(), stages.end(),
                                       [&](const ModuleRange& r) { return r.end == llama_num_modules(args); });
    sim.hold(MemCategory::workspace, widened_product_bytes(args, mb, tp, !p.disable_loss_parallel, with_head));
  }

  Buf grads, adam_m, adam_v;
  const auto ensure_grads = [&] {
    if (!fsdp && !grads) grads = sim.alloc(MemCategory::gradients, owned * 4);
  };
  const int64_t B = pipeline ? p.pipeline_parallel_microbatch_size : cfg.training.local_batch_size;
  ModelSim model(sim, {args, B, cfg.training.seq_len, dt, ac, tp, p.enable_sequence_parallel, !p.disable_loss_parallel},
                 stages, fsdp ? &fsdp_sim : nullptr, ensure_grads);
  RankEstimate out;
  for (int step = 0; step < 2; ++step) {
    if (step == 1) out.tensor_parallel_bytes += static_cast<double>(model.tp_bytes);  // the first step's
    // begin_step: gradients kept from the last step are zeroed; FSDP makes its shard's here.
    if (fsdp && !grads) grads = sim.alloc(MemCategory::gradients, owned * 4);
    for (int64_t i = 0; i < par.accum_steps; ++i) {
      if (pipeline) {
        PipelineSim pass(sim, model, par.pp_schedule, pp_rank, p.pipeline_parallel_keep_outputs);
        pass.run();
        if (step == 0) out.pipeline_bytes += pass.bytes_sent + pass.bytes_received;
      } else {
        SimStageSaved saved;
        (void)model.forward(0, nullptr, saved);
        (void)model.backward_from_loss(0, saved, /*split=*/false);
      }
    }
    if (fsdp) fsdp_sim.finish();
    if (tp > 1 && step == 0)  // the gradient norm's sum of squares (one f32) over tp
      out.tensor_parallel_bytes += static_cast<double>(2 * (tp - 1) * 4 / tp);
    if (pipeline && step == 0) {  // the loss and its token count, and the norm's sum of squares, over pp
      const int P = par.pp_size;
      out.pipeline_bytes += static_cast<double>(2 * (P - 1) * 8 / P + 2 * (P - 1) * 4 / P);
    }
    if (!adam_m) {  // AdamW's moments, created at the first optimizer step
      adam_m = sim.alloc(MemCategory::optimizer_state, owned * 4);
      adam_v = sim.alloc(MemCategory::optimizer_state, owned * 4);
    }
    sim.trim_cache();  // as the trainer, after each step
  }

  // A checkpoint save (ParallelizedModel::save_checkpoint): global tensors of
  // the weights and both moments, gathered over FSDP (a full copy of each,
  // group by group), then over tp, then over pp onto pp rank 0; an
  // asynchronous save also stages a copy of every tensor on rank 0.
  grads = nullptr;  // the trainer releases the gradients before a save or a validation pass
  if (cfg.checkpoint.enable) {
    sim.release_cache();  // the trainer empties the cache before a save
    const size_t numel = static_cast<size_t>(local.numel());
    // Weights, exp_avg and exp_avg_sq, unless the only save is the last and it is model-only.
    const bool only_last = cfg.checkpoint.interval >= cfg.training.steps;
    const int copies = only_last && cfg.checkpoint.last_save_model_only ? 1 : 3;
    std::vector<Buf> held, global(static_cast<size_t>(copies));
    if (fsdp) {  // FsdpParams::gather_full: a whole local copy, gathered group by group
      size_t largest = 0;
      for (const ParamGroup& g : local.groups())
        largest = std::max(largest, static_cast<size_t>(fsdp_shard_numel(g.numel, par.layout.dp_shard())));
      for (int c = 0; c < copies; ++c) {
        held.push_back(sim.alloc(MemCategory::workspace, numel * 4));
        sim.touch(MemCategory::communication, static_cast<size_t>(par.layout.dp_shard()) * largest * 4);
      }
    }
    if (tp > 1) {  // gather_tp_global: the stage's global tensors, parameter by parameter
      size_t largest = 0;
      for (const ParamSpec& sp : local.specs())
        if (!sp.slice.replicated()) largest = std::max(largest, static_cast<size_t>(sp.numel()));
      for (Buf& g : global) {
        g = sim.alloc(MemCategory::workspace, static_cast<size_t>(padded_numel(stage_specs)) * 4);
        sim.touch(MemCategory::communication, static_cast<size_t>(tp) * largest * 4);
      }
    }
    if (pipeline) {  // gather_pipeline_stages: the whole model's, on pp rank 0; each replaces the stage's
      for (Buf& g : global) {
        Buf whole;
        if (pp_rank == 0) {
          whole = sim.alloc(MemCategory::workspace, static_cast<size_t>(padded_numel(llama_param_specs(args))) * 4);
          for (int r = 1; r < par.pp_size; ++r)
            sim.touch(MemCategory::communication,
                      static_cast<size_t>(padded_numel(llama_param_specs(
                          args, pipeline_rank_modules(args, par.pp_split, par.pp_schedule.placement, r)))) *
                          4);
        }
        g = std::move(whole);
      }
    }
    if (cfg.checkpoint.async_mode != "disabled" && world_rank0)
      held.push_back(sim.alloc(MemCategory::workspace, static_cast<size_t>(args.num_params()) * 4 * copies));
  }

  sim.release_cache();  // and after it

  out.memory.peak = sim.peaks();
  // Per-op scratch comes and goes inside one op, on top of what is live.
  TrainShape mb_shape = step_shape;
  mb_shape.local_batch_size = B;
  const size_t scratch = op_scratch_bytes(args, mb_shape, tp, !p.disable_loss_parallel);
  out.memory.peak[static_cast<int>(MemCategory::workspace)] += scratch;
  out.memory.peak_total = sim.peak_total() + scratch;
  // The ops' scratch blocks are asked for every step: each stays in the
  // allocator's cache between its uses, all of them beside the peak.
  // (Reserved bytes are never fewer than live ones: a scratch too large to be
  // cached still comes on top of the peak while its op runs.)
  out.memory.peak_reserved = std::max(
      sim.peak_reserved() + op_scratch_cached_bytes(args, mb_shape, tp, !p.disable_loss_parallel),
      out.memory.peak_total);
  return out;
}

}  // namespace

LayoutEstimate estimate_layout(const JobConfig& cfg, const ModelArgs& args, int world_size) {
  LayoutEstimate est;
  est.par = resolve_parallel(cfg, args, world_size, 0);
  const Parallel& par = est.par;
  est.flops_per_token = flops_per_token(args, cfg.training.seq_len);
  // The data-parallel closed form (dist/comm_volume.h) over this rank's groups.
  std::vector<RankEstimate> per_pp;
  RankEstimate rank0;
  for (int pp = 0; pp < par.pp_size; ++pp) {
    RankEstimate r = simulate_rank(cfg, args, par, pp, /*world_rank0=*/world_size == 1);
    if (par.pp_size > 1) r.stages = par.pp_schedule.placement.stages_of(pp);
    else r.stages = {0};
    r.pp_rank = pp;
    const std::vector<ModuleRange> stages =
        par.pp_size > 1 ? pipeline_rank_modules(args, par.pp_split, par.pp_schedule.placement, pp)
                        : std::vector<ModuleRange>{{0, llama_num_modules(args)}};
    const DType dt = compute_dtype(cfg);
    const ParamStore local(tensor_parallel_param_specs(llama_param_specs(args, stages), par.tp_size, 0), dt, false);
    const ReshardPolicy reshard = parse_reshard_policy(cfg.parallelism.fsdp_reshard_after_forward);
    if (par.mode == DataParallelMode::fsdp)
      r.data_parallel_bytes = fsdp_bytes_per_step(local.groups(), par.layout.dp_shard(), par.layout.dp_replicate(),
                                                  static_cast<int>(dtype_size(dt)), reshard,
                                                  par.accum_steps * par.pp_micro_batches,
                                                  par.pp_size > 1 && reshard == ReshardPolicy::default_policy);
    else if (par.mode == DataParallelMode::ddp)
      r.data_parallel_bytes = ddp_bytes_per_step(local.groups(), par.dp_size);
    if (pp == 0) {
      rank0 = r;
      if (world_size > 1) rank0.memory = simulate_rank(cfg, args, par, 0, /*world_rank0=*/true).memory;
    }
    per_pp.push_back(std::move(r));
  }
  const MeshLayout& layout = par.layout;
  for (int rank = 0; rank < world_size; ++rank) {
    const int pp = world_size > 1 ? layout.group_rank(rank, MeshGroup::pp) : 0;
    RankEstimate r = rank == 0 ? rank0 : per_pp[static_cast<size_t>(pp)];
    r.rank = rank;
    est.ranks.push_back(std::move(r));
  }
  return est;
}

}  // namespace anvil
