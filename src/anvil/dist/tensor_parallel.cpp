#include "anvil/dist/tensor_parallel.h"

#include <algorithm>

#include "anvil/core/error.h"
#include "anvil/core/profiler.h"

namespace anvil {

CommTensorParallel::CommTensorParallel(Communicator& tp, Options options)
    : TensorParallel(tp.rank(), tp.size(), options), comm_(tp) {}

namespace {

// A blocking collective, traced (while profiling) as a span on the calling
// thread with the bytes this rank sent, so the trace shows its bandwidth.
template <class Run>
void traced(const char* label, CommOp op, uint64_t payload_bytes, int group_size, Run&& run) {
  Profiler& p = Profiler::instance();
  if (!p.recording()) return run();
  const double begin = steady_now_us();
  run();
  p.add({{label, -1}, SpanCategory::communication, p.thread_index(), begin, steady_now_us(),
         comm_bytes(op, payload_bytes, group_size)});
}

// Reductions of bf16 travel as fp32 (comm.h accumulates in fp32).
uint64_t reduced_bytes(const Tensor& t) { return static_cast<uint64_t>(t.numel()) * 4; }

}  // namespace

void CommTensorParallel::all_reduce_sum(const Tensor& t) {
  traced("tp.all_reduce", CommOp::all_reduce, t.dtype() == DType::bf16 ? reduced_bytes(t) : t.nbytes(), comm_.size(), [&] { comm_.all_reduce(t); });
}

void CommTensorParallel::all_reduce_max(const Tensor& t) {
  traced("tp.all_reduce_max", CommOp::all_reduce, t.dtype() == DType::bf16 ? reduced_bytes(t) : t.nbytes(), comm_.size(), [&] { comm_.all_reduce(t, ReduceOp::max); });
}

void CommTensorParallel::all_gather(const Tensor& shard, const Tensor& full) {
  traced("tp.all_gather", CommOp::all_gather, full.nbytes(), comm_.size(), [&] { comm_.all_gather(shard, full); });
}

void CommTensorParallel::reduce_scatter(const Tensor& full, const Tensor& shard) {
  traced("tp.reduce_scatter", CommOp::reduce_scatter, full.dtype() == DType::bf16 ? reduced_bytes(full) : full.nbytes(), comm_.size(),
         [&] { comm_.reduce_scatter(full, shard); });
}

Tensor gather_tp_global(Communicator& tp, const std::vector<ParamSpec>& local_specs, const Tensor& local_flat,
                        const std::vector<ParamSpec>& global_specs, int64_t global_numel) {
  ANVIL_ASSERT(local_specs.size() == global_specs.size() && local_flat.dtype() == DType::f32);
  Tensor global = Tensor::zeros({global_numel}, DType::f32, MemCategory::workspace, "tp.global_state");
  for (size_t i = 0; i < local_specs.size(); ++i) {
    const ParamSpec& l = local_specs[i];
    const ParamSpec& g = global_specs[i];
    ANVIL_ASSERT(l.name == g.name && l.global_shape() == g.shape, l.name, " vs ", g.name);
    const Tensor mine = local_flat.slice(l.offset, l.numel());
    const Tensor out = global.slice(g.offset, g.numel()).view(g.shape);
    if (l.tp.replicated()) {
      Tensor dst = out.view({g.numel()});
      dst.copy_from(mine);
      continue;
    }
    Tensor stacked = Tensor::empty({tp.size() * l.numel()}, DType::f32, MemCategory::communication, "tp.gather_state");
    tp.all_gather(mine, stacked);
    assemble_global(l, tp.size(), stacked, out);
  }
  return global;
}

std::vector<Tensor> grads_counted_once(const ParamStore& params, const Tensor& grads, int tp_rank,
                                       const FsdpParams* fsdp, int dp_shard_rank) {
  if (tp_rank == 0) return {grads};  // everything (padding and unused shard tails are zero)
  std::vector<Tensor> out;
  for (const ParamSpec& s : params.specs()) {
    if (s.tp.replicated()) continue;
    if (fsdp == nullptr) {
      out.push_back(grads.slice(s.offset, s.numel()));
      continue;
    }
    // The part of the parameter inside this rank's FSDP shard of its group:
    // group-local elements [r·n, (r+1)·n), stored from shard_offset(g).
    const ParamGroup& g = params.groups()[static_cast<size_t>(s.group)];
    const int64_t n = fsdp->group_shard_numel(s.group);
    const int64_t shard_begin = g.offset + dp_shard_rank * n;
    const int64_t lo = std::max(s.offset, shard_begin), hi = std::min(s.offset + s.numel(), shard_begin + n);
    if (lo < hi) out.push_back(grads.slice(fsdp->shard_offset(s.group) + (lo - shard_begin), hi - lo));
  }
  return out;
}

}  // namespace anvil
