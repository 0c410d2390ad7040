#include "anvil/train/state_layout.h"

#include <map>
#include <string>

#include "anvil/distributed/fsdp.h"
#include "anvil/distributed/tensor_parallel.h"
#include "anvil/ops/grad_norm.h"
#include "anvil/pipeline/executor.h"

namespace anvil {

std::vector<ModuleRange> rank_stages(const ModelArgs& args, const ParallelDims& par) {
  if (par.pp_size == 1) return {{0, llama_num_modules(args)}};
  return pipeline_rank_modules(args, par.pp_split, par.pp_schedule.placement, par.pp_rank);
}

RankStateLayout::RankStateLayout(const ModelArgs& args, const ParallelDims& par, const ParamStore& local,
                                 FsdpParams* fsdp, bool tensor_parallel)
    : args_(args),
      par_(par),
      local_(local),
      fsdp_(fsdp),
      tensor_parallel_(tensor_parallel),
      stage_global_(std::make_unique<ParamStore>(
          llama_param_specs(args, rank_stages(args, par), ExpertShard{par.ep_rank, par.ep_size}), DType::f32,
          /*allocate=*/false)),
      whole_(std::make_unique<ParamStore>(llama_param_specs(args), DType::f32, /*allocate=*/false)) {}

RankStateLayout::~RankStateLayout() = default;

const std::vector<ParamSpec>& RankStateLayout::global_specs() const { return whole_->specs(); }

int64_t RankStateLayout::global_numel() const { return whole_->numel(); }

namespace {
// Under expert parallelism: the whole model's buffer from the ep group's
// local ones (each rank's parameters, its experts among them), each element
// written by one rank — its expert's holder, or ep rank 0 for the weights
// every rank holds alike — and summed over the ranks (x + 0 + … is exact).
Tensor gather_experts(Communicator& ep, const std::vector<ParamSpec>& local_specs, const Tensor& local,
                      const std::vector<ParamSpec>& global_specs, int64_t global_numel) {
  std::map<std::string, const ParamSpec*> by_name;
  for (const ParamSpec& g : global_specs) by_name[g.name] = &g;
  Tensor global = Tensor::zeros({global_numel}, DType::f32, MemCategory::workspace, "ep.global_state");
  for (const ParamSpec& l : local_specs) {
    if (!l.expert && ep.rank() != 0) continue;
    const ParamSpec& g = *by_name.at(l.name);
    Tensor dst = global.slice(g.offset, g.numel());
    dst.copy_from(local.slice(l.offset, l.numel()));
  }
  ep.all_reduce(global);
  return global;
}
}  // namespace

Tensor RankStateLayout::to_global(const Tensor& rank_state) const {
  Tensor state = fsdp_ ? fsdp_->gather_full(rank_state) : rank_state;
  if (tensor_parallel_)  // this rank's parameters (its experts among them), whole
    state = gather_tp_global(par_.mesh->tp(), local_.specs(), state, stage_global_->specs(), stage_global_->numel());
  if (par_.ep_size > 1) {  // the ep group's states make its stages' tensors
    Tensor global = gather_experts(par_.mesh->group(MeshGroup::ep), stage_global_->specs(), state, whole_->specs(),
                                   whole_->numel());
    if (par_.pp_size > 1) par_.mesh->pp().all_reduce(global);  // each stage's tensors, zero elsewhere: exact
    return global;
  }
  if (par_.pp_size > 1)
    state = gather_pipeline_stages(par_.mesh->pp(), args_, par_.pp_split, par_.pp_schedule.placement, state);
  return state;
}

void RankStateLayout::from_local(const Tensor& local, Tensor& rank_state) const {
  if (fsdp_)
    fsdp_->scatter_full(local, rank_state);
  else if (local.raw() != rank_state.raw())
    rank_state.copy_from(local);
}

void RankStateLayout::from_global(const Tensor& global, Tensor& rank_state) const {
  if (!tensor_parallel_ && par_.pp_size == 1 && par_.ep_size == 1) return from_local(global, rank_state);  // local = global
  // Under FSDP this tp rank's slices of its stages are staged whole, then sharded.
  Tensor local =
      fsdp_ ? Tensor::empty({local_.numel()}, DType::f32, MemCategory::workspace, "state.local") : rank_state;
  global_flat_to_local(whole_->specs(), global, local_.specs(), local);
  if (fsdp_) fsdp_->scatter_full(local, rank_state);
}

double RankStateLayout::global_sum_of_squares(const Tensor& rank_state) const {
  if (par_.ep_size > 1 && !fsdp_) {
    // DDP: every rank's replicated part once; each rank's experts summed over the ep group; under TP
    // the slices of every tp rank, the tensors it replicates on tp rank 0 only; then every stage.
    std::vector<Tensor> dense, experts;
    for (const ParamSpec& s : local_.specs()) {
      if (tensor_parallel_ && s.slice.replicated() && par_.tp_rank != 0) continue;
      (s.expert ? experts : dense).push_back(rank_state.slice(s.offset, s.numel()));
    }
    Tensor t = Tensor::empty({1}, DType::f32, MemCategory::communication, "grad_norm.experts_sum");
    t.data<float>()[0] = static_cast<float>(grad_sum_of_squares(experts));
    par_.mesh->group(MeshGroup::ep).all_reduce(t);
    t.data<float>()[0] += static_cast<float>(grad_sum_of_squares(dense));
    if (tensor_parallel_) par_.mesh->tp().all_reduce(t);
    if (par_.pp_size > 1) par_.mesh->pp().all_reduce(t);  // and every stage's
    return t.data<float>()[0];
  }
  const Tensor all[] = {rank_state};
  // Under TP each global element is counted on one tp rank only (replicated norms on tp rank 0).
  double sum_sq = tensor_parallel_ ? grad_sum_of_squares(grads_counted_once(local_, rank_state, par_.tp_rank, fsdp_,
                                                                            fsdp_ ? par_.fsdp_shard_group().rank() : 0))
                                   : grad_sum_of_squares(all);
  // Each shard and stage holds part of the state; replicas hold the same parts. Under expert
  // parallelism the dp_shard ranks are the ep ranks times each expert's shards: summed over
  // them, every expert counts once.
  if (fsdp_ || tensor_parallel_ || par_.pp_size > 1) {
    Tensor t = Tensor::empty({1}, DType::f32, MemCategory::communication, "grad_norm.sum");
    t.data<float>()[0] = static_cast<float>(sum_sq);
    if (fsdp_) par_.fsdp_shard_group().all_reduce(t);
    if (tensor_parallel_) par_.mesh->tp().all_reduce(t);
    if (par_.pp_size > 1) par_.mesh->pp().all_reduce(t);
    sum_sq = t.data<float>()[0];
  }
  return sum_sq;
}

}  // namespace anvil
