#include "anvil/distributed/fsdp.h"

#include <algorithm>

#include "anvil/core/dry_run.h"
#include "anvil/core/error.h"
#include "anvil/core/parallel_for.h"
#include "anvil/core/profiler.h"

namespace anvil {

ReshardPolicy parse_reshard_policy(const std::string& s) {
  if (s == "default") return ReshardPolicy::default_policy;
  if (s == "always") return ReshardPolicy::always;
  if (s == "never") return ReshardPolicy::never;
  throw Error(detail::concat("parallelism.fsdp_reshard_after_forward is '", s, "'; use default, always or never"));
}

int64_t fsdp_shard_numel(int64_t group_numel, int n) {
  const int64_t per_rank = (group_numel + n - 1) / n;
  return (per_rank + 31) / 32 * 32;
}

bool fsdp_keep_after_forward(const std::vector<ParamGroup>& groups, int group, ReshardPolicy reshard) {
  switch (reshard) {
    case ReshardPolicy::never: return true;
    case ReshardPolicy::always: return false;
    case ReshardPolicy::default_policy: break;
  }
  // The last block's weights are needed again at once by the backward.
  const size_t next = static_cast<size_t>(group) + 1;
  return next < groups.size() && groups[next].module == ModuleKind::head;
}

FsdpParams::FsdpParams(ParamStore& model, Communicator& shard, Communicator* replicate, ReshardPolicy reshard)
    : model_(model), shard_(shard), replicate_(replicate), reshard_(reshard), n_(shard.size()) {
  const auto& groups = model.groups();
  for (const ParamGroup& g : groups) {
    shard_numel_.push_back(fsdp_shard_numel(g.numel, n_));
    shard_offset_.push_back(shard_total_);
    shard_total_ += shard_numel_.back();
  }
  master_ = Tensor::zeros({shard_total_}, DType::f32, MemCategory::parameters, "fsdp.master_shard");
  compute_ = model.compute_dtype() == DType::f32
                 ? master_
                 : Tensor::zeros({shard_total_}, DType::bf16, MemCategory::parameters, "fsdp.compute_shard");
  gathered_.resize(groups.size());
  full_grads_.resize(groups.size());
  open_backwards_.assign(groups.size(), 0);
  gathering_.resize(groups.size());
  gather_id_.resize(groups.size(), -1);
}

void FsdpParams::scatter_full(const Tensor& full, Tensor& shard_state) {
  const auto& groups = model_.groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    const int64_t begin = shard_.rank() * shard_numel_[g];
    const int64_t len = std::clamp<int64_t>(groups[g].numel - begin, 0, shard_numel_[g]);
    Tensor dst = shard_state.slice(shard_offset_[g], shard_numel_[g]);
    dst.zero_();  // the padding past the group's end stays zero
    if (len > 0) dst.slice(0, len).copy_from(full.slice(groups[g].offset + begin, len));
  }
}

void FsdpParams::load_full_master(const Tensor& full_master) {
  scatter_full(full_master, master_);
  sync_compute_copy();
}

void FsdpParams::sync_compute_copy() {
  if (compute_.dtype() != master_.dtype()) compute_.copy_from(master_);
}

Tensor FsdpParams::gather_full(const Tensor& shard_state) {
  const auto& groups = model_.groups();
  int64_t total = 0;
  for (const ParamGroup& g : groups) total = std::max(total, g.offset + g.numel);
  Tensor full = Tensor::zeros({total}, DType::f32, MemCategory::workspace, "fsdp.gathered_state");
  for (size_t g = 0; g < groups.size(); ++g) {
    Tensor all = Tensor::empty({n_ * shard_numel_[g]}, DType::f32, MemCategory::communication, "fsdp.gather_state");
    shard_.all_gather(shard_state.slice(shard_offset_[g], shard_numel_[g]), all);
    full.slice(groups[g].offset, groups[g].numel).copy_from(all.slice(0, groups[g].numel));
  }
  return full;
}


void FsdpParams::zero_grad() {
  if (!grads_.defined())
    grads_ = Tensor::zeros({shard_total_}, DType::f32, MemCategory::gradients, "fsdp.grad_shard");
  else
    grads_.zero_();
}

void FsdpParams::gather(int group, bool async) {
  const size_t g = static_cast<size_t>(group);
  if (gathered_[g].defined()) return;
  gathered_[g] = Tensor::empty({n_ * shard_numel_[g]}, compute_.dtype(), MemCategory::communication,
                               "fsdp.gathered_weights");
  const Tensor mine = compute_.slice(shard_offset_[g], shard_numel_[g]);
  const int id = tracker_.start("fsdp.all_gather", layer_of(group), CommOp::all_gather, gathered_[g].nbytes(), n_);
  if (async) {
    gathering_[g] = shard_.iall_gather(mine, gathered_[g]);
    gather_id_[g] = id;
  } else {
    const ScopedPhase phase(SpanCategory::communication, "fsdp.all_gather", layer_of(group));
    const CommTracker::Blocked blocked(tracker_);
    shard_.all_gather(mine, gathered_[g]);
    tracker_.done(id);
  }
}

void FsdpParams::wait_gather(int group) {
  Work& w = gathering_[static_cast<size_t>(group)];
  if (w.pending()) {
    const ScopedPhase phase(SpanCategory::communication, "fsdp.all_gather.wait", layer_of(group));
    const CommTracker::Blocked blocked(tracker_);
    w.wait();
  }
  int& id = gather_id_[static_cast<size_t>(group)];
  if (id >= 0) tracker_.done(id);
  id = -1;
}

void FsdpParams::progress() {
  // MPI moves data inside these calls: their time is communication the main
  // thread pays for, so it counts as blocked.
  const CommTracker::Blocked blocked(tracker_);
  for (size_t g = 0; g < gathering_.size(); ++g)
    if (gathering_[g].pending() && gathering_[g].test() && gather_id_[g] >= 0) {
      tracker_.done(gather_id_[g]);
      gather_id_[g] = -1;
    }
  // Reductions in flight are only tested here (MPI progresses them inside
  // the call); they are folded into the shard when a third is queued or at
  // finish(), never earlier, so the full-gradient buffers live a fixed span
  // whatever the network's timing and the estimator can name the peak.
  for (Pending& p : reducing_) (void)p.work.test();
}

void FsdpParams::before_forward(int group) {
  gather(group, false);
  wait_gather(group);
  model_.bind_group(group, gathered_[static_cast<size_t>(group)], Tensor());
  if (group + 1 < static_cast<int>(model_.groups().size())) gather(group + 1, true);  // prefetch
  progress();
}

void FsdpParams::after_forward(int group) {
  model_.unbind_group(group);
  if (!hold_for_step_ && !fsdp_keep_after_forward(model_.groups(), group, reshard_))
    gathered_[static_cast<size_t>(group)] = Tensor();
}

void FsdpParams::before_backward(int group) {
  const size_t g = static_cast<size_t>(group);
  gather(group, false);
  wait_gather(group);
  if (!full_grads_[g].defined())  // the head's is made once for its fused forward and backward
    full_grads_[g] = Tensor::zeros({n_ * shard_numel_[g]}, DType::f32, MemCategory::gradients, "fsdp.full_grads");
  model_.bind_group(group, gathered_[g], full_grads_[g]);
  ++open_backwards_[g];
  if (group > 0) gather(group - 1, true);  // prefetch for the next backward
  progress();
}

void FsdpParams::after_backward(int group) {
  const size_t g = static_cast<size_t>(group);
  ANVIL_ASSERT(open_backwards_[g] > 0, "group ", group, "'s backward ends without beginning");
  if (--open_backwards_[g] > 0) return;  // another micro-batch still adds to its full gradients
  Pending p;
  p.group = group;
  p.full = std::move(full_grads_[g]);
  model_.unbind_group(group);
  if (!hold_for_step_) gathered_[g] = Tensor();
  p.partial = Tensor::empty({shard_numel_[g]}, DType::f32, MemCategory::communication, "fsdp.grad_partial");
  p.id = tracker_.start("fsdp.reduce_scatter", layer_of(group), CommOp::reduce_scatter, p.full.nbytes(), n_);
  // Held here, not by the Work, so it goes at complete() whenever the exchange ends.
  p.pieces = Tensor::empty({p.full.numel()}, DType::f32, MemCategory::communication, "fsdp.grad_pieces");
  p.work = shard_.ireduce_scatter(p.full, p.partial, ReduceOp::sum, p.pieces);
  reducing_.push_back(std::move(p));
  // At most two groups' gradients in flight: enough to overlap the next
  // group's backward, bounded in memory.
  while (reducing_.size() > 2) {
    const ScopedPhase wait(SpanCategory::communication, "fsdp.reduce_scatter.wait", layer_of(reducing_.front().group));
    complete(reducing_.front());
    reducing_.erase(reducing_.begin());
  }
  progress();
}

void FsdpParams::complete(Pending& p) {
  if (p.work.pending()) {
    const CommTracker::Blocked blocked(tracker_);
    p.work.wait();
  }
  tracker_.done(p.id);
  Tensor mine = grads_.slice(shard_offset_[static_cast<size_t>(p.group)], shard_numel_[static_cast<size_t>(p.group)]);
  const float* src = p.partial.data<float>();
  float* dst = mine.data<float>();
  parallel_for(0, dry_run() ? 0 : mine.numel(), 1 << 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) dst[i] += src[i];
  });
  p.full = p.partial = p.pieces = Tensor();
}

void FsdpParams::finish() {
  if (hold_for_step_)  // the step is over: reshard every group
    for (size_t g = 0; g < gathered_.size(); ++g) {
      wait_gather(static_cast<int>(g));
      gathered_[g] = Tensor();
    }
  {
    const ScopedPhase phase(SpanCategory::communication, "fsdp.reduce_scatter.wait");
    for (Pending& p : reducing_) complete(p);
    reducing_.clear();
  }
  if (replicate_ != nullptr && replicate_->size() > 1) {
    const ScopedPhase phase(SpanCategory::communication, "hsdp.all_reduce");
    const int id = tracker_.start("hsdp.all_reduce", -1, CommOp::all_reduce, grads_.nbytes(), replicate_->size());
    const CommTracker::Blocked blocked(tracker_);
    replicate_->all_reduce(grads_);
    tracker_.done(id);
  }
}

}  // namespace anvil
