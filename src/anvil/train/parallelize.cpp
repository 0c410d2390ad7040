#include "anvil/train/parallelize.h"

#include <algorithm>
#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "anvil/core/allocator.h"
#include "anvil/core/error.h"
#include "anvil/core/profiler.h"
#include "anvil/distributed/comm_volume.h"
#include "anvil/distributed/context_parallel.h"
#include "anvil/distributed/ddp.h"
#include "anvil/distributed/expert_parallel.h"
#include "anvil/distributed/fsdp.h"
#include "anvil/distributed/tensor_parallel.h"
#include "anvil/model/llama.h"
#include "anvil/ops/grad_norm.h"
#include "anvil/pipeline/executor.h"
#include "anvil/train/model_source.h"

namespace anvil {

namespace {

// The model's constructor and the tensor-parallel API are named only in this
// block, so a change to either is made here and nowhere else in the trainer.

// The model as this rank holds it: its pipeline stage's modules (all of them
// without pipeline parallelism), this tp rank's slices communicating over the
// tp group when tensor_parallel_degree > 1. allocate_params = false: the model
// keeps no weights of its own (FSDP lends each group's while it runs).
// Under context parallelism the style (the tensor-parallel one, or a plain
// one made for it) runs RoPE and attention through `cp`.
void build_model(const JobConfig& cfg, const ModelArgs& args, const ParallelDims& par, DType compute_dtype,
                 bool allocate_params, ComputeCopy compute_copy, ReshardPolicy reshard, std::unique_ptr<TensorParallelStyle>& tp, std::unique_ptr<ContextParallel>& cp,
                 std::unique_ptr<ParallelStyle>& plain_style, std::unique_ptr<ExpertExchange>& experts,
                 std::unique_ptr<Llama>& model) {
  if (par.ep_size > 1)
    experts = std::make_unique<MpiExpertExchange>(par.mesh->group(MeshGroup::ep), cfg.model.moe_estimate_load);
  if (par.tp_size > 1)
    tp = std::make_unique<TensorParallelStyle>(
        par.mesh->tp(), args,
        TensorParallelOptions{.sequence_parallel = cfg.parallelism.enable_sequence_parallel,
                              .loss_parallel = !cfg.parallelism.disable_loss_parallel});
  ParallelStyle* style = tp.get();
  if (par.cp_size > 1) {
    cp = std::make_unique<ContextParallel>(par.mesh->cp(), par.cp_balancer, par.cp_rotate);
    if (!style) style = (plain_style = std::make_unique<ParallelStyle>()).get();
    style->set_sequence_layout(cp.get());
  }
  model = std::make_unique<Llama>(args, compute_dtype, cfg.training.seq_len,
                                  LlamaOptions{.stages = rank_stages(args, par),
                                               .parallel_style = style,
                                               .allocate_params = allocate_params,
                                               .compute_copy = compute_copy,
                                               .cast_reshard = reshard,
                                               .expert_shard = {par.ep_rank, par.ep_size},
                                               .expert_exchange = experts.get()});
}

}  // namespace

void sum_loss_over_dp(const ParallelDims& par, double& loss_sum, int64_t& tokens) {
  if (!par.distributed()) return;
  float totals[2] = {static_cast<float>(loss_sum), static_cast<float>(tokens)};
  par.sum_over_dp(totals, 2);
  loss_sum = totals[0];
  tokens = static_cast<int64_t>(totals[1]);
}

ParallelizedModel::ParallelizedModel(const JobConfig& cfg, const ModelArgs& args, const ParallelDims& par,
                                     DType compute_dtype)
    : cfg_(cfg), args_(args), par_(par), compute_dtype_(compute_dtype) {
  // Under FSDP the model holds no weights of its own: FsdpParams keeps this
  // rank's shards and lends each group's gathered weights while the group runs.
  const bool fsdp_mode = par.mode == DataParallelMode::fsdp;
  // Without FSDP, bf16 weights are cast per group while the group runs (16
  // bytes per parameter, as FSDP2 on one device), except under pipeline
  // parallelism, where every micro-batch would cast each group again: there a
  // whole bf16 copy is kept, as FSDP under PP keeps its gathered weights.
  // (The model makes its casts itself: LlamaOptions::compute_copy.)
  const ComputeCopy copy = !fsdp_mode && par.pp_size == 1 ? ComputeCopy::per_group : ComputeCopy::whole;
  const ReshardPolicy reshard = parse_reshard_policy(cfg.parallelism.fsdp_reshard_after_forward);
  std::optional<ScopedPhase> setup_phase(std::in_place, SpanCategory::step, "model.init");
  build_model(cfg, args, par, compute_dtype, /*allocate_params=*/!fsdp_mode, copy, reshard, tp_, cp_, plain_style_,
              experts_, model_);
  ParamStore& ps = model_->params();
  if (fsdp_mode) {
    const bool hsdp = par.mesh->layout().dp_replicate() > 1;
    // Under expert parallelism each rank's experts are sharded over the ranks holding the same ones.
    fsdp_ =
        std::make_unique<FsdpParams>(ps, par.fsdp_shard_group(), hsdp ? &par.mesh->dp_replicate() : nullptr, reshard,
                                     par.ep_size > 1 ? &par.mesh->group(MeshGroup::expert_shard) : nullptr);
    model_->set_hooks(fsdp_.get());
    // Under pipeline parallelism each micro-batch would gather every group
    // again: by default the stage's gathered weights stay for the whole step
    // (torchtitan's default under PP), and the console says so.
    hold_gathered_ = par.pp_size > 1 && reshard == ReshardPolicy::default_policy;
    fsdp_->hold_gathered_for_step(hold_gathered_);
  } else if (par.mode == DataParallelMode::ddp) {
    ddp_ = std::make_unique<DdpGradSync>(ps, par.mesh->dp());
    model_->set_hooks(ddp_.get());
  }
  // What the layout should send per step, to set against what it does.
  if (fsdp_)
    comm_closed_form_ = fsdp_bytes_per_step(
        ps.groups(), par.fsdp_shard_degree(), par.mesh->layout().dp_replicate(), compute_dtype == DType::bf16 ? 2 : 4,
        reshard, par.accum_steps * par.pp_micro_batches, hold_gathered_, par.expert_shard_degree());
  else if (ddp_)
    comm_closed_form_ = ddp_bytes_per_step(ps.groups(), par.dp_size);
  state_layout_ = std::make_unique<RankStateLayout>(args, par, ps, fsdp_.get(), tp_ != nullptr);
  if (par.pp_size > 1) {
    pipeline_ = std::make_unique<PipelineExecutor>(*model_, par.mesh->pp(), par.pp_schedule,
                                                cfg.parallelism.pipeline_parallel_keep_outputs);
  }
  // The global model's initialisation, of which each rank keeps its part.
  if (fsdp_) {
    ParamStore full(ps.specs(), DType::f32);  // this tp rank's slices of its stages, whole
    full.init(static_cast<uint64_t>(cfg.training.seed));
    state_layout_->from_local(full.master_flat(), fsdp_->master());
    fsdp_->sync_compute_copy();
  } else {
    ps.init(static_cast<uint64_t>(cfg.training.seed));
  }
  setup_phase.reset();
  ps.release_grads();  // each step's backward creates them
  // The optimizer updates this rank's master weights (its FSDP shard, or the model's) and their bf16 copy, if one
  // is kept.
  Tensor* compute_copy = compute_dtype == DType::bf16 && copy == ComputeCopy::whole
                            ? (fsdp_ ? &fsdp_->compute() : &ps.compute_flat())
                            : nullptr;
  const OptimizerConfig optimizer = optimizer_config(cfg);
  if (optimizer.kind == OptimizerKind::muon) {
    // Newton-Schulz needs each matrix whole: the optimizer gathers FSDP's
    // runs of it, and then the tp slices, to an owner rank (optimizer.h).
    ANVIL_CHECK(master().device().is_cpu(), "optimizer.name = \"Muon\" trains on the CPU so far; set job.device = "
                "\"cpu\" or optimizer.name = \"AdamW\"");
  }
  optimizer_ = std::make_unique<RankOptimizer>(optimizer, ps.specs(), master(), compute_copy, fsdp_.get(),
                                               tp_ ? &par.mesh->tp() : nullptr);
}

ParallelizedModel::~ParallelizedModel() = default;

void ParallelizedModel::print_comm_closed_form() const {
  if (hold_gathered_)
    std::printf("anvil: FSDP under pipeline parallelism keeps each stage's gathered weights for the whole step (one "
                "all-gather per group per step, not two per micro-batch); parallelism.fsdp_reshard_after_forward = "
                "\"always\" frees them after each use instead\n");
  if (par_.distributed())
    std::printf("anvil: data-parallel traffic per rank per step, closed form: %s\n",
                human_bytes(static_cast<size_t>(comm_closed_form_)).c_str());
  if (optimizer_->config().kind == OptimizerKind::muon) {
    std::printf("anvil: Muon's Newton-Schulz on this rank: %.3g GFLOP per step", optimizer_flops_per_step() / 1e9);
    if (fsdp_ || tp_)
      std::printf(" (the matrices it owns); gathering them and scattering their updates sends %s per step",
                  human_bytes(static_cast<size_t>(optimizer_bytes_per_step())).c_str());
    std::printf("\n");
  }
}

Tensor& ParallelizedModel::master() { return fsdp_ ? fsdp_->master() : model_->params().master_flat(); }

void ParallelizedModel::sync_compute_copy() {
  model_->release_casts();  // a group kept cast holds the weights before the load
  if (fsdp_)
    fsdp_->sync_compute_copy();
  else
    model_->params().sync_compute_copy();
}

void ParallelizedModel::load_global_weights(const std::function<void(ParamStore&)>& read) {
  if (state_layout_->is_global()) return read(model_->params());
  // Every rank reads the global tensors and keeps its part.
  ParamStore global(state_layout_->global_specs(), DType::f32);
  read(global);
  state_layout_->from_global(global.master_flat(), master());
  sync_compute_copy();
}

nlohmann::json ParallelizedModel::load_checkpoint(const Checkpointer& checkpointer, int64_t step) {
  optimizer_->create_state();
  const CheckpointOptimizer kinds = checkpoint_optimizer(optimizer_->config());
  nlohmann::json state;
  if (state_layout_->is_global()) {
    auto [m, v] = optimizer_->state_in_master_layout();
    state = checkpointer.load(step, state_layout_->global_specs(), master(), m, v, kinds);
    optimizer_->set_state_from_master_layout(m, v);
  } else {  // every rank reads the global tensors and keeps its part
    const int64_t n = state_layout_->global_numel();
    Tensor gw = Tensor::empty({n}, DType::f32, MemCategory::workspace, "checkpoint.weights");
    Tensor gm = Tensor::empty({n}, DType::f32, MemCategory::workspace, "checkpoint.exp_avg");
    Tensor gv = Tensor::empty({n}, DType::f32, MemCategory::workspace, "checkpoint.exp_avg_sq");
    state = checkpointer.load(step, state_layout_->global_specs(), gw, gm, gv, kinds);
    state_layout_->from_global(gw, master());
    auto [m, v] = optimizer_->state_in_master_layout();
    state_layout_->from_global(gm, m);
    state_layout_->from_global(gv, v);
    optimizer_->set_state_from_master_layout(m, v);
  }
  sync_compute_copy();
  return state;
}

void ParallelizedModel::save_checkpoint(Checkpointer& checkpointer, int64_t step, bool model_only, DType model_dtype,
                                        const std::function<CheckpointMeta()>& meta) {
  // Checkpoints hold the whole model's tensors whatever the layout, one
  // state after another (weights, then each moment), and rank 0 writes. The
  // previous save's copy is let go before this one's gathers, so every save
  // holds the same memory as the first.
  checkpointer.wait();
  const Tensor w = state_layout_->to_global(master());
  Tensor m, v;
  if (!model_only) {
    // Under AdamW the moments themselves; under Muon copies laid out as the weights (optimizer.h).
    auto [first, second] = optimizer_->state_in_master_layout();
    m = state_layout_->to_global(first);
    v = state_layout_->to_global(second);
  }
  if (par_.rank0())
    checkpointer.save(step, state_layout_->global_specs(), w, model_only ? nullptr : &m, model_only ? nullptr : &v,
                      meta(), model_dtype, checkpoint_optimizer(optimizer_->config()));
}

void ParallelizedModel::begin_moe_step(const MicroBatches& batches) {
  MoeStepState* moe = model_->moe_state();
  if (!moe) return;
  moe->begin_step();
  // The step's sequences over the data-parallel ranks: a micro-batch row is
  // a whole sequence, or under context parallelism a chunk of one (the layout says how many).
  int64_t sequences = 0;
  for (const Tensor& t : batches.tokens) sequences += cp_ ? cp_->sequences(t.size(0)) : t.size(0);
  model_->set_step_sequences(sequences * par_.dp_size);
}

MoeReport ParallelizedModel::moe_report() {
  MoeReport r;
  const MoeStepState* moe = model_->moe_state();
  if (!moe) return r;
  r.num_experts = moe->num_experts;
  // The routes, then the aux sum and its term count, summed over the data-parallel ranks and the pipeline
  // stages (f32: exact counts to 2^24).
  std::vector<float> sums(moe->routes.begin(), moe->routes.end());
  sums.push_back(static_cast<float>(moe->aux_sum));
  sums.push_back(static_cast<float>(moe->aux_terms));
  par_.sum_over_dp(sums.data(), static_cast<int>(sums.size()));
  if (pipeline_) {  // each stage holds its own layers: their routes and aux terms add up over the stages
    Tensor t = Tensor::empty({static_cast<int64_t>(sums.size())}, DType::f32, MemCategory::communication, "pp.moe");
    std::copy(sums.begin(), sums.end(), t.data<float>());
    par_.mesh->pp().all_reduce(t);
    std::copy(t.data<float>(), t.data<float>() + sums.size(), sums.begin());
  }
  r.routes.assign(sums.begin(), sums.end() - 2);
  r.received_rows = moe->received_rows;
  r.received_share = moe->received_share;
  const double terms = sums.back();
  r.aux_loss = terms > 0 ? sums[sums.size() - 2] / terms : 0.0;
  return r;
}

ForwardBackwardResult ParallelizedModel::forward_backward(const MicroBatches& batches, float grad_scale,
                                                          const AcPolicy& policy, const ForwardBackwardHooks& hooks) {
  begin_moe_step(batches);
  if (!pipeline_) {
    const ForwardBackwardHooks with_sync{[&](int64_t i, int64_t n) { before_micro_batch(i, n); }, hooks.stop_requested};
    ForwardBackwardResult r = forward_backward_single_stage(*model_, batches, grad_scale, policy, with_sync);
    r.moe = moe_report();
    return r;
  }
  // Each micro-batch of local_batch_size sequences runs through the pipeline
  // as pp_micro_batches smaller ones (views of its rows).
  ForwardBackwardResult result;
  const int64_t n = batches.size(), m = par_.pp_micro_batches;
  for (int64_t i = 0; i < n; ++i) {
    const Tensor& tokens = batches.tokens[static_cast<size_t>(i)];
    const Tensor& targets = batches.targets[static_cast<size_t>(i)];
    const Tensor documents = batches.documents_of(static_cast<size_t>(i));
    const int64_t rows = tokens.size(0) / m;
    std::vector<Tensor> mb_tokens, mb_targets, mb_documents;
    for (int64_t j = 0; j < m; ++j) {
      mb_tokens.push_back(tokens.slice(j * rows, rows));
      mb_targets.push_back(targets.slice(j * rows, rows));
      // Whole sequences: under context parallelism a micro-batch's rows are its sequences' chunks, two each.
      if (documents.defined()) {
        const int64_t seqs = documents.size(0) / m;
        mb_documents.push_back(documents.slice(j * seqs, seqs));
      }
    }
    // DDP reduces once per step: during the last pipeline micro-batch's
    // backward (its W pass, when split) of the step's last micro-batch — every
    // stage runs its backwards in micro-batch order.
    const auto sync = [&](int j) {
      if (ddp_) ddp_->set_sync(i == n - 1 && j == m - 1);
    };
    const PipelineResult r = pipeline_->run(mb_tokens, mb_targets, grad_scale, policy, sync, mb_documents);
    result.loss_sum += r.loss_sum;
    result.loss_tokens += r.loss_tokens;
    if (hooks.stop_requested && hooks.stop_requested()) {
      result.stopped_after = i + 1;
      break;
    }
  }
  sum_loss_over_pp(result.loss_sum, result.loss_tokens);  // every rank reports the true loss
  result.moe = moe_report();
  return result;
}

CrossEntropyResult ParallelizedModel::evaluate(const Tensor& tokens, const Tensor& targets, const Tensor& documents) {
  if (!pipeline_) {
    const CrossEntropyResult r = evaluate_single_stage(*model_, tokens, targets, documents);
    model_->release_casts();  // the last block keeps its cast for a backward that will not come
    return r;
  }
  CrossEntropyResult r = pipeline_->evaluate(tokens, targets, documents);
  sum_loss_over_pp(r.loss_sum, r.num_tokens);
  return r;
}

void ParallelizedModel::sum_loss_over_pp(double& loss_sum, int64_t& tokens) {
  // Only the last stage has a loss; every rank reports the sum.
  Tensor t = Tensor::empty({2}, DType::f32, MemCategory::communication, "pp.loss");
  t.data<float>()[0] = static_cast<float>(loss_sum);
  t.data<float>()[1] = static_cast<float>(tokens);
  par_.mesh->pp().all_reduce(t);
  loss_sum = t.data<float>()[0];
  tokens = static_cast<int64_t>(t.data<float>()[1]);
}

void ParallelizedModel::begin_step() {
  model_->release_casts();  // what a step stopped mid-way kept
  model_->params().zero_kept_grads();  // the first step's backward creates them
  if (fsdp_) fsdp_->zero_grad();
}

void ParallelizedModel::before_micro_batch(int64_t i, int64_t n) {
  if (ddp_) ddp_->set_sync(i == n - 1);
}

void ParallelizedModel::finish_backward() {
  if (ddp_) ddp_->finish();
  if (fsdp_) fsdp_->finish();
}

Tensor& ParallelizedModel::grads() { return fsdp_ ? fsdp_->grads() : model_->params().grad_flat(); }

double ParallelizedModel::grad_norm() {
  return grad_norm_from_sum_of_squares(state_layout_->global_sum_of_squares(grads()));
}

void ParallelizedModel::optimizer_step(double lr_factor, int64_t step, float clip) {
  optimizer_->step(lr_factor, step, grads(), clip);
}

uint64_t ParallelizedModel::take_optimizer_comm_bytes() { return optimizer_->take_comm_stats().bytes; }

double ParallelizedModel::optimizer_flops_per_step() const { return optimizer_->newton_schulz_flops_per_step(); }

double ParallelizedModel::optimizer_bytes_per_step() const {
  return static_cast<double>(optimizer_->exchange_bytes_per_step());
}

void ParallelizedModel::update_expert_bias(const MoeReport& moe) {
  if (moe.num_experts > 0) model_->update_expert_bias(moe.routes);
}

nlohmann::json ParallelizedModel::model_state() const { return model_state_of(*model_); }

void ParallelizedModel::load_model_state(const nlohmann::json& state) { apply_model_state(state, *model_); }

void ParallelizedModel::release_grads() {
  model_->params().release_grads();
  if (fsdp_) fsdp_->release_grads();
}

StepComm ParallelizedModel::take_comm_stats() {
  StepComm out;
  if (ddp_) out.data_parallel = ddp_->tracker().take();
  else if (fsdp_) out.data_parallel = fsdp_->tracker().take();
  if (tp_) {
    out.tp_bytes = par_.mesh->tp().counters().total_bytes();
    par_.mesh->tp().reset_counters();
  }
  if (pipeline_) {
    out.pp_bytes = par_.mesh->pp().counters().total_bytes();
    par_.mesh->pp().reset_counters();
  }
  if (experts_) {  // the ep group carries expert parallelism's all-to-alls alone
    Communicator& ep = par_.mesh->group(MeshGroup::ep);
    out.ep_bytes = ep.counters().bytes_of(CommOp::all_to_all);
    ep.reset_counters();
  }
  return out;
}

}  // namespace anvil
