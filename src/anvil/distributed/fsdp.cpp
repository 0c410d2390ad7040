#include "anvil/distributed/fsdp.h"

#include <algorithm>

#include "anvil/core/dry_run.h"
#include "anvil/core/error.h"
#include "anvil/core/parallel_for.h"
#include "anvil/core/profiler.h"

namespace anvil {

int64_t fsdp_shard_numel(int64_t group_numel, int n) {
  const int64_t per_rank = (group_numel + n - 1) / n;
  return (per_rank + 31) / 32 * 32;
}

int64_t fsdp_dense_numel(const ParamGroup& g) {
  int64_t n = 0;
  for (const auto& [offset, numel] : g.data_parallel_runs) n += numel;
  return n;
}

FsdpParams::FsdpParams(ParamStore& model, Communicator& shard, Communicator* replicate, ReshardPolicy reshard,
                       Communicator* expert_shard)
    : model_(model),
      shard_(shard),
      replicate_(replicate),
      expert_shard_(expert_shard),
      reshard_(reshard),
      n_(shard.size()) {
  const auto& groups = model.groups();
  const auto& specs = model.specs();
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    const ParamGroup& g = groups[gi];
    // Each parameter's elements (its padding included) go to the dense part or
    // the experts', packed in order: its place in that part's gathered slices.
    Part parts[2];
    std::vector<int64_t> at;
    std::vector<bool> expert;
    for (int i = g.first; i < g.end; ++i) {
      const ParamSpec& sp = specs[static_cast<size_t>(i)];
      const int64_t len = (i + 1 < g.end ? specs[static_cast<size_t>(i) + 1].offset : g.offset + g.numel) - sp.offset;
      Part& p = parts[sp.expert ? 1 : 0];
      if (!p.runs.empty() && p.runs.back().first + p.runs.back().second == sp.offset)
        p.runs.back().second += len;
      else
        p.runs.emplace_back(sp.offset, len);
      at.push_back(p.numel);
      expert.push_back(sp.expert);
      param_place_.push_back({static_cast<int>(gi), sp.expert ? 1 : 0, p.numel});
      p.numel += len;
    }
    parts[0].comm = &shard_;
    parts[0].n = n_;
    parts[0].shard = fsdp_shard_numel(parts[0].numel, n_);
    std::vector<Part> kept{parts[0]};
    if (parts[1].numel > 0) {
      ANVIL_ASSERT(expert_shard_ != nullptr, "group ", gi, " holds expert weights: FSDP needs their shard group");
      Part& e = parts[1];
      e.comm = expert_shard_;
      e.n = expert_shard_->size();
      e.shard = fsdp_shard_numel(e.numel, e.n);
      e.shard_at = parts[0].shard;
      e.gathered_at = n_ * parts[0].shard;
      for (size_t j = 0; j < at.size(); ++j)
        if (expert[j]) at[j] += e.gathered_at;
      kept.push_back(e);
    }
    const Part& last = kept.back();
    model.set_bound_layout(static_cast<int>(gi), at, last.gathered_at + last.n * last.shard);
    shard_numel_.push_back(last.shard_at + last.shard);
    shard_offset_.push_back(shard_total_);
    shard_total_ += shard_numel_.back();
    parts_.push_back(std::move(kept));
  }
  ANVIL_ASSERT(param_place_.size() == specs.size(), "FSDP: the groups hold ", param_place_.size(), " of the ",
               specs.size(), " parameters");
  master_ = Tensor::zeros({shard_total_}, DType::f32, MemCategory::parameters, "fsdp.master_shard");
  compute_ = model.compute_dtype() == DType::f32
                 ? master_
                 : Tensor::zeros({shard_total_}, DType::bf16, MemCategory::parameters, "fsdp.compute_shard");
  gathered_.resize(groups.size());
  full_grads_.resize(groups.size());
  open_backwards_.assign(groups.size(), 0);
  gathering_.resize(groups.size());
}

FsdpParams::ParamShards FsdpParams::param_shards(int param) const {
  const ParamPlace& place = param_place_.at(static_cast<size_t>(param));
  const Part& p = parts_[static_cast<size_t>(place.group)][static_cast<size_t>(place.part)];
  return {p.comm, place.at, p.shard, shard_offset_[static_cast<size_t>(place.group)] + p.shard_at};
}

namespace {
// Elements [begin, begin + packed.numel()) of a part, counted along its runs
// of the flat buffer `flat`, copied into `packed` (or back, from packed).
template <class Part>
void copy_part(const Part& p, const Tensor& flat, int64_t begin, const Tensor& packed, bool into_packed) {
  const int64_t end = begin + packed.numel();
  int64_t pos = 0;
  for (const auto& [offset, numel] : p.runs) {
    const int64_t lo = std::max(begin, pos), hi = std::min(end, pos + numel);
    if (lo < hi) {
      Tensor f = flat.slice(offset + (lo - pos), hi - lo), q = packed.slice(lo - begin, hi - lo);
      if (into_packed)
        q.copy_from(f);
      else
        f.copy_from(q);
    }
    pos += numel;
  }
}
}  // namespace

void FsdpParams::scatter_full(const Tensor& full, Tensor& shard_state) {
  for (size_t g = 0; g < parts_.size(); ++g)
    for (const Part& p : parts_[g]) {
      const int64_t begin = p.comm->rank() * p.shard;
      const int64_t len = std::clamp<int64_t>(p.numel - begin, 0, p.shard);
      Tensor dst = shard_state.slice(shard_offset_[g] + p.shard_at, p.shard);
      dst.zero_();  // the padding past the part's end stays zero
      if (len > 0) copy_part(p, full, begin, dst.slice(0, len), /*into_packed=*/true);
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
  for (size_t g = 0; g < parts_.size(); ++g)
    for (const Part& p : parts_[g]) {
      Tensor all = Tensor::empty({p.n * p.shard}, DType::f32, MemCategory::communication, "fsdp.gather_state");
      p.comm->all_gather(shard_state.slice(shard_offset_[g] + p.shard_at, p.shard), all);
      copy_part(p, full, 0, all.slice(0, p.numel), /*into_packed=*/false);
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
  gathered_[g] =
      Tensor::empty({model_.bound_numel(group)}, compute_.dtype(), MemCategory::communication, "fsdp.gathered_weights");
  for (size_t k = 0; k < parts_[g].size(); ++k) {
    const Part& p = parts_[g][k];
    const Tensor mine = compute_.slice(shard_offset_[g] + p.shard_at, p.shard);
    const Tensor all = gathered_[g].slice(p.gathered_at, p.n * p.shard);
    const char* label = k == 0 ? "fsdp.all_gather" : "fsdp.all_gather.experts";
    const int id = tracker_.start(label, layer_of(group), CommOp::all_gather, all.nbytes(), p.n);
    if (async) {
      gathering_[g].work[k] = p.comm->iall_gather(mine, all);
      gathering_[g].id[k] = id;
    } else {
      const ScopedPhase phase(SpanCategory::communication, label, layer_of(group));
      const CommTracker::Blocked blocked(tracker_);
      p.comm->all_gather(mine, all);
      tracker_.done(id);
    }
  }
}

void FsdpParams::wait_gather(int group) {
  Gathering& w = gathering_[static_cast<size_t>(group)];
  for (int k = 0; k < 2; ++k) {
    if (w.work[k].pending()) {
      const ScopedPhase phase(SpanCategory::communication, "fsdp.all_gather.wait", layer_of(group));
      const CommTracker::Blocked blocked(tracker_);
      w.work[k].wait();
    }
    if (w.id[k] >= 0) tracker_.done(w.id[k]);
    w.id[k] = -1;
  }
}

void FsdpParams::progress() {
  // MPI moves data inside these calls: their time is communication the main
  // thread pays for, so it counts as blocked.
  const CommTracker::Blocked blocked(tracker_);
  for (Gathering& w : gathering_)
    for (int k = 0; k < 2; ++k)
      if (w.work[k].pending() && w.work[k].test() && w.id[k] >= 0) {
        tracker_.done(w.id[k]);
        w.id[k] = -1;
      }
  // Reductions in flight are only tested here (MPI progresses them inside
  // the call); they are folded into the shard when a third is queued or at
  // finish(), never earlier, so the full-gradient buffers live a fixed span
  // whatever the network's timing and the estimator can name the peak.
  for (Pending& p : reducing_)
    for (Work& w : p.work) (void)w.test();
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
  if (!hold_for_step_ && !keep_after_forward(model_.groups(), group, reshard_))
    gathered_[static_cast<size_t>(group)] = Tensor();
}

void FsdpParams::before_backward(int group) {
  const size_t g = static_cast<size_t>(group);
  gather(group, false);
  wait_gather(group);
  if (!full_grads_[g].defined())  // the head's is made once for its fused forward and backward
    full_grads_[g] = Tensor::zeros({model_.bound_numel(group)}, DType::f32, MemCategory::gradients, "fsdp.full_grads");
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
  for (size_t k = 0; k < parts_[g].size(); ++k) {
    const Part& part = parts_[g][k];
    const Tensor full = p.full.slice(part.gathered_at, part.n * part.shard);
    p.partial[k] = Tensor::empty({part.shard}, DType::f32, MemCategory::communication, "fsdp.grad_partial");
    p.id[k] = tracker_.start(k == 0 ? "fsdp.reduce_scatter" : "fsdp.reduce_scatter.experts", layer_of(group),
                             CommOp::reduce_scatter, full.nbytes(), part.n);
    // Held here, not by the Work, so it goes at complete() whenever the exchange ends.
    p.pieces[k] = Tensor::empty({full.numel()}, DType::f32, MemCategory::communication, "fsdp.grad_pieces");
    p.work[k] = part.comm->ireduce_scatter(full, p.partial[k], ReduceOp::sum, p.pieces[k]);
  }
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
  const size_t g = static_cast<size_t>(p.group);
  for (size_t k = 0; k < parts_[g].size(); ++k) {
    if (p.work[k].pending()) {
      const CommTracker::Blocked blocked(tracker_);
      p.work[k].wait();
    }
    tracker_.done(p.id[k]);
    Tensor mine = grads_.slice(shard_offset_[g] + parts_[g][k].shard_at, parts_[g][k].shard);
    const float* src = p.partial[k].data<float>();
    float* dst = mine.data<float>();
    parallel_for(0, dry_run() ? 0 : mine.numel(), 1 << 16, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) dst[i] += src[i];
    });
  }
  for (int k = 0; k < 2; ++k) p.pieces[k] = p.partial[k] = Tensor();
  p.full = Tensor();
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
