#include "anvil/distributed/tensor_parallel.h"

#include <algorithm>
#include <map>
#include <string>

#include "anvil/core/dry_run.h"
#include "anvil/core/error.h"
#include "anvil/core/parallel_for.h"
#include "anvil/core/profiler.h"
#include "anvil/ops/embedding.h"
#include "anvil/ops/matmul.h"

namespace anvil {

// Per block, with tp ranks, M token rows, and M_l = M/tp rows per rank under sequence
// parallelism (SP), else M; W_t is rank t's slice:
//
//   forward (x: M_l rows)                           backward (dout: M_l rows)
//   h1 = norm(x); SP: all-gather h1 to M rows       SP: all-gather dout to M rows
//   q, k, v = h1·W{q,k,v}_tᵀ (the rank's heads)     dO = dout·Wo_t; dWo_t += doutᵀ·o
//   o = attention(q, k, v)                          attention backward on the rank's heads
//   x2 = x + Σ_t o·Wo_tᵀ: the partial sums          dh1 = Σ_t (dq·Wq_t + dk·Wk_t + dv·Wv_t): the partial
//        reduce-scattered (SP) or all-reduced            sums reduce-scattered (SP) or all-reduced
//                                                   dx += norm backward(dh1)
//   (the feed-forward the same way: gate/up column-parallel like q/k/v, down row-parallel like o)
//
// Without SP the norms run on every rank on identical rows, so the norm weights' gradients
// agree without communication; with SP each rank normalises only its rows, and those
// gradients are summed over tp (one small all-reduce per block and one for the final norm).
// Row-parallel partial sums and input gradients are reduced in fp32 (bf16 reductions travel
// as fp32 anyway) and rounded to the compute dtype once.

int64_t padded_vocab_size(int64_t vocab_size, int tp) {
  ANVIL_ASSERT(tp >= 1 && vocab_size >= 1);
  return (vocab_size + tp - 1) / tp * tp;
}

TensorParallelStyle::TensorParallelStyle(Communicator& tp, const ModelArgs& args, TensorParallelOptions options)
    : comm_(tp), args_(args), options_(options) {
  const int64_t T = tp.size();
  ANVIL_CHECK(args.n_heads % T == 0 && args.n_kv_heads % T == 0, args.name, "/", args.flavor, ": ", T,
              " tensor-parallel ranks must divide n_heads ", args.n_heads, " and n_kv_heads ", args.n_kv_heads);
  ANVIL_CHECK(args.ffn_hidden_dim() % T == 0, args.name, "/", args.flavor, ": ", T,
              " tensor-parallel ranks must divide the feed-forward width ", args.ffn_hidden_dim());
  ANVIL_CHECK(!args.moe() || args.moe_ffn_hidden % T == 0, args.name, "/", args.flavor, ": ", T,
              " tensor-parallel ranks must divide the experts' width ", args.moe_ffn_hidden);
}

std::vector<ParamSpec> TensorParallelStyle::shard_params(std::vector<ParamSpec> specs) const {
  return tensor_parallel_param_specs(std::move(specs), size(), rank());
}

std::vector<ParamSpec> tensor_parallel_param_specs(std::vector<ParamSpec> specs, int T, int rank) {
  if (T == 1) return specs;
  auto ends_with = [](const std::string& name, const char* suffix) {
    const std::string s = suffix;
    return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
  };
  for (ParamSpec& s : specs) {
    int dim = -1;  // the split dimension; -1 replicated
    int64_t global = 0;
    for (const char* column : {"q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight"})
      if (ends_with(s.name, column)) dim = 0, global = s.shape[0];
    for (const char* row : {"o_proj.weight", "down_proj.weight"})
      if (ends_with(s.name, row)) dim = 1, global = s.shape[1];
    const bool vocabulary = s.name == "model.embed_tokens.weight" || s.name == "lm_head.weight";
    if (vocabulary) dim = 0, global = s.shape[0];
    if (dim < 0) continue;
    const int64_t padded = vocabulary ? padded_vocab_size(global, T) : global;
    ANVIL_ASSERT(padded % T == 0, s.name, ": ", global, " over ", T, " ranks");  // the constructor checked the heads
    const int64_t extent = padded / T;
    s.shape[static_cast<size_t>(dim)] = extent;
    s.slice = GlobalSlice{dim, rank * extent, global};
  }
  return specs;
}

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
uint64_t reduced_bytes(const Tensor& t) { return t.dtype() == DType::bf16 ? static_cast<uint64_t>(t.numel()) * 4 : t.nbytes(); }

// dst (D) f32 += src (D) f32
void add_into(const Tensor& src, const Tensor& dst) {
  if (dry_run()) return;
  const float* a = src.data<float>();
  float* b = dst.data<float>();
  for (int64_t i = 0; i < dst.numel(); ++i) b[i] += a[i];
}

}  // namespace

void TensorParallelStyle::all_reduce_sum(const Tensor& t) const {
  traced("tp.all_reduce", CommOp::all_reduce, reduced_bytes(t), size(), [&] { comm_.all_reduce(t); });
}

void TensorParallelStyle::all_reduce_max(const Tensor& t) const {
  traced("tp.all_reduce_max", CommOp::all_reduce, reduced_bytes(t), size(),
         [&] { comm_.all_reduce(t, ReduceOp::max); });
}

void TensorParallelStyle::all_gather(const Tensor& shard, const Tensor& full) const {
  traced("tp.all_gather", CommOp::all_gather, full.nbytes(), size(), [&] { comm_.all_gather(shard, full); });
}

void TensorParallelStyle::reduce_scatter(const Tensor& full, const Tensor& shard) const {
  traced("tp.reduce_scatter", CommOp::reduce_scatter, reduced_bytes(full), size(),
         [&] { comm_.reduce_scatter(full, shard); });
}

int64_t TensorParallelStyle::residual_rows(int64_t M) const {
  if (!sequence_parallel()) return M;
  ANVIL_CHECK(M % size() == 0, "sequence parallelism splits the ", M,
              " tokens of a micro-batch (batch x sequence length) over ", size(),
              " tensor-parallel ranks, which must divide them");
  return M / size();
}

int64_t TensorParallelStyle::vocab_rows(const Tensor& w) const {
  return std::clamp<int64_t>(args_.vocab_size - vocab_begin(w), 0, w.size(0));
}

// Vocabulary-parallel: each rank looks up the ids in its range (zero rows for the rest);
// the sum over tp is the lookup, exactly (one nonzero term per row).
Tensor TensorParallelStyle::embedding_forward(const Tensor& tokens, const Tensor& weight, DType dt) const {
  const int64_t M = tokens.numel(), Ml = residual_rows(M), D = weight.size(1);
  Tensor partial = new_activation({M, D}, dt, Ml == M ? "embed.out" : "embed.partial");
  embedding_forward_shard(tokens, weight, vocab_begin(weight), args_.vocab_size, partial);
  if (Ml == M) {
    all_reduce_sum(partial);
    return partial;
  }
  Tensor h = new_activation({Ml, D}, dt, "embed.out");
  reduce_scatter(partial, h);
  return h;
}

void TensorParallelStyle::embedding_backward(const Tensor& dh, const Tensor& tokens, Tensor grad) const {
  const Tensor full = gather_rows(dh, "embed.dout");
  embedding_backward_shard(full, tokens, vocab_begin(grad), args_.vocab_size, grad);
}

Tensor TensorParallelStyle::gather_rows(const Tensor& local, const char* tag) const {
  if (!sequence_parallel()) return local;
  Tensor full = new_activation({local.size(0) * size(), local.size(1)}, local.dtype(), tag);
  all_gather(local, full);
  return full;
}

Tensor TensorParallelStyle::partial_with_residual(const Tensor& residual, int64_t M, const char* tag) const {
  const int64_t D = residual.size(1), Ml = residual_rows(M), r = rank();
  const bool sp = sequence_parallel();
  // The residual enters the sum once: on every rank's own rows (SP) or on rank 0 only.
  Tensor partial = Tensor::empty({M, D}, DType::f32, MemCategory::activations, tag);
  if (sp) {
    for (int64_t q = 0; q < size(); ++q) {
      Tensor rows = partial.slice(q * Ml, Ml);
      if (q == r) rows.copy_from(residual);
      else rows.zero_();
    }
  } else if (r == 0) {
    partial.copy_from(residual);
  } else {
    partial.zero_();
  }
  return partial;
}

Tensor TensorParallelStyle::row_parallel_out(const Tensor& residual, const Tensor& in, const Tensor& w,
                                             const char* tag) const {
  const DType dt = residual.dtype();
  const char* partial_tag = sequence_parallel() || dt != DType::f32 ? "tp.partial" : tag;  // non-SP f32: the output
  Tensor partial = partial_with_residual(residual, in.size(0), partial_tag);
  linear_forward_accumulate(in, w, partial);  // (M, D) += in (M, K_t) · w (D, K_t)ᵀ
  return reduce_partial(partial, dt, tag);     // the same reduction as an input gradient's, and one rounding
}

Tensor TensorParallelStyle::reduce_partial_out(const Tensor& residual, const Tensor& partial, const char* tag) const {
  Tensor sum = partial_with_residual(residual, partial.size(0), "tp.partial");
  const Tensor add = partial.dtype() == DType::f32 ? partial : partial.to(DType::f32, MemCategory::activations, "tp.moe_partial");
  float* dst = sum.data<float>();
  const float* src = add.data<float>();
  parallel_for(0, dry_run() ? 0 : sum.numel(), 1 << 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) dst[i] += src[i];
  });
  return reduce_partial(sum, residual.dtype(), tag);
}

Tensor TensorParallelStyle::reduce_partial_grad(const Tensor& partial, DType dt, const char* tag) const {
  if (partial.dtype() == DType::f32) return reduce_partial(partial, dt, tag);
  return reduce_partial(partial.to(DType::f32, MemCategory::activations, "tp.partial"), dt, tag);
}

Tensor TensorParallelStyle::column_input_grad(std::initializer_list<InputGradTerm> terms, DType dt,
                                              const char* tag) const {
  const InputGradTerm& first = *terms.begin();
  Tensor partial = Tensor::empty({first.dy.size(0), first.w.size(1)}, DType::f32, MemCategory::activations,
                                 "tp.partial");
  bool accumulate = false;
  for (const InputGradTerm& t : terms) {
    linear_backward_input(t.dy, t.w, partial, accumulate);
    accumulate = true;
  }
  return reduce_partial(partial, dt, tag);
}

Tensor TensorParallelStyle::reduce_partial(const Tensor& partial, DType dt, const char* tag) const {
  ANVIL_ASSERT(partial.dtype() == DType::f32);
  const int64_t M = partial.size(0), D = partial.size(1), Ml = residual_rows(M);
  Tensor reduced = partial;
  if (sequence_parallel()) {
    reduced = Tensor::empty({Ml, D}, DType::f32, MemCategory::activations, dt == DType::f32 ? tag : "tp.partial_rows");
    reduce_scatter(partial, reduced);
  } else {
    all_reduce_sum(partial);
  }
  if (dt == DType::f32) return reduced;
  Tensor out = new_activation({Ml, D}, dt, tag);
  out.copy_from(reduced);
  return out;
}

// Under sequence parallelism each rank's norm-weight gradients cover its rows only: they
// are gathered in a zeroed scratch, summed over tp, then added to the gradients (adding the
// sum into the gradients directly would also re-sum earlier micro-batches' accumulation).
// The residual stream's norms see a share of the rows only under sequence
// parallelism; the q/k norms always see a share of the heads. Either way each
// rank's gradient is a partial sum: it goes to a zeroed scratch that
// finish_norm_grads all-reduces and adds to the gradients (which may already
// hold earlier micro-batches').
NormGradTargets TensorParallelStyle::norm_grad_targets(std::initializer_list<Tensor> grads, NormRows rows) const {
  if (rows == NormRows::residual && !sequence_parallel()) return {grads, Tensor()};
  const int64_t k = static_cast<int64_t>(grads.size()), D = grads.begin()->numel();
  NormGradTargets t;
  t.scratch = Tensor::zeros(k == 1 ? Shape{D} : Shape{k, D}, DType::f32, MemCategory::gradients, "tp.norm_grads");
  for (int64_t i = 0; i < k; ++i) t.at.push_back(k == 1 ? t.scratch : t.scratch.slice(i, 1).view({D}));
  return t;
}

void TensorParallelStyle::finish_norm_grads(const NormGradTargets& targets, std::initializer_list<Tensor> grads) const {
  if (!targets.scratch.defined()) return;
  all_reduce_sum(targets.scratch);  // every norm's gradient in one all-reduce
  size_t i = 0;
  for (const Tensor& g : grads) add_into(targets.at[i++], g);
}

Tensor TensorParallelStyle::gather_output_weight(const Tensor& local) const {
  Tensor full = Tensor::empty({local.size(0) * size(), local.size(1)}, local.dtype(), MemCategory::communication,
                              "tp.output_weight");
  all_gather(local, full);
  return full;
}

CrossEntropyResult TensorParallelStyle::loss_parallel_lse(const Tensor& hn, const Tensor& w, int64_t begin,
                                                          const Tensor& targets, Tensor& lse) const {
  const int64_t M = hn.size(0);
  // stats (3, M): this shard's row max, Σ exp(logit − max), target logit.
  Tensor stats = Tensor::empty({3, M}, DType::f32, MemCategory::workspace, "loss_parallel.stats");
  cross_entropy_shard_stats(hn, w, targets, begin, args_.vocab_size, stats);
  Tensor global_max = Tensor::empty({M}, DType::f32, MemCategory::workspace, "loss_parallel.max");
  global_max.copy_from(stats.slice(0, 1));
  all_reduce_max(global_max);
  cross_entropy_rescale_sumexp(stats, global_max, targets);
  all_reduce_sum(stats.slice(1, 2));  // Σ exp(logit − max) and the target's logit, over the shards
  return cross_entropy_combine_rows(global_max, stats, targets, lse);
}

CrossEntropyResult TensorParallelStyle::loss_forward_backward(const Tensor& hn, const Tensor& w_local, Tensor dw_local,
                                                              const Tensor& targets, float grad_scale,
                                                              Tensor& dhn) const {
  const int64_t M = hn.size(0), D = hn.size(1), V = args_.vocab_size;
  // This rank's real vocabulary rows: the padding takes no part in the softmax.
  const int64_t rows = vocab_rows(w_local), begin = vocab_begin(w_local);
  Tensor dw = dw_local.slice(0, rows);
  if (loss_parallel()) {
    const Tensor w = w_local.slice(0, rows);
    Tensor lse = Tensor::empty({M}, DType::f32, MemCategory::workspace, "loss_parallel.lse");
    const CrossEntropyResult loss = loss_parallel_lse(hn, w, begin, targets, lse);
    // dx = Σ_t dlogits_t · w_t: this rank's term, summed over tp like a row-parallel output.
    Tensor dx = Tensor::empty({M, D}, DType::f32, MemCategory::activations, "tp.partial");
    cross_entropy_shard_backward(hn, w, targets, begin, lse, grad_scale, dx, dw);
    dhn = reduce_partial(dx, hn.dtype(), "final_norm.dout");
    return loss;
  }
  // Loss parallel off: every rank runs the whole head on the gathered weight (the same
  // numbers as gathering the logits, without ever holding them), keeps its rows of dW and
  // its rows of dX, which every rank computed alike.
  const Tensor full = gather_output_weight(w_local);
  Tensor dw_full = Tensor::zeros({V, D}, DType::f32, MemCategory::gradients, "tp.output_grad");
  Tensor dx = new_activation({M, D}, hn.dtype(), "final_norm.dout");
  const CrossEntropyResult loss = cross_entropy_forward_backward(hn, full.slice(0, V), targets, grad_scale, dx, dw_full);
  const float* src = dw_full.data<float>() + begin * D;
  float* dst = dw.data<float>();
  for (int64_t i = 0; i < rows * D && !dry_run(); ++i) dst[i] += src[i];
  const int64_t Ml = residual_rows(M);
  if (Ml == M) {
    dhn = dx;
  } else {
    dhn = new_activation({Ml, D}, hn.dtype(), "final_norm.dout");
    dhn.copy_from(dx.slice(rank() * Ml, Ml));
  }
  return loss;
}

CrossEntropyResult TensorParallelStyle::loss_forward(const Tensor& hn, const Tensor& w, const Tensor& targets) const {
  if (loss_parallel()) {
    Tensor lse = Tensor::empty({hn.size(0)}, DType::f32, MemCategory::workspace, "loss_parallel.lse");
    return loss_parallel_lse(hn, w.slice(0, vocab_rows(w)), vocab_begin(w), targets, lse);
  }
  return cross_entropy_forward(hn, gather_output_weight(w).slice(0, args_.vocab_size), targets);
}

void copy_global_to_local(const ParamSpec& spec, const Tensor& global, const Tensor& local) {
  ANVIL_ASSERT(global.shape() == spec.global_shape() && local.shape() == spec.shape, spec.name, ": global ",
               shape_str(global.shape()), " local ", shape_str(local.shape()));
  Tensor flat = global.view({global.numel()});
  Tensor whole = local;
  if (!spec.slice.replicated()) whole.zero_();  // the vocabulary padding
  for_each_global_run(spec, local, [&](Tensor run, int64_t offset) { run.copy_from(flat.slice(offset, run.numel())); });
}

void assemble_global(const ParamSpec& spec, int tp, const Tensor& stacked, const Tensor& global) {
  ANVIL_ASSERT(global.shape() == spec.global_shape() && stacked.numel() == tp * spec.numel(), spec.name, ": global ",
               shape_str(global.shape()), " from ", shape_str(stacked.shape()));
  Tensor flat = global.view({global.numel()});
  if (spec.slice.replicated()) {  // the same on every rank: rank 0's
    flat.copy_from(stacked.view({stacked.numel()}).slice(0, spec.numel()));
    return;
  }
  const int64_t extent = spec.shape[static_cast<size_t>(spec.slice.dim)];
  for (int t = 0; t < tp; ++t) {
    ParamSpec of_rank = spec;
    of_rank.slice.begin = t * extent;
    const Tensor local = stacked.view({stacked.numel()}).slice(t * spec.numel(), spec.numel()).view(spec.shape);
    for_each_global_run(of_rank, local, [&](Tensor run, int64_t offset) {
      Tensor dst = flat.slice(offset, run.numel());
      dst.copy_from(run);
    });
  }
}

void global_flat_to_local(const std::vector<ParamSpec>& global_specs, const Tensor& global_flat,
                          const std::vector<ParamSpec>& local_specs, const Tensor& local_flat) {
  std::map<std::string, const ParamSpec*> by_name;
  for (const ParamSpec& g : global_specs) by_name[g.name] = &g;
  for (const ParamSpec& l : local_specs) {
    const auto it = by_name.find(l.name);
    ANVIL_ASSERT(it != by_name.end(), l.name, " is not in the global layout");
    const ParamSpec& g = *it->second;
    ANVIL_ASSERT(g.name == l.name && g.shape == l.global_shape(), g.name, " vs ", l.name);
    copy_global_to_local(l, global_flat.slice(g.offset, g.numel()).view(g.shape),
                         local_flat.slice(l.offset, l.numel()).view(l.shape));
  }
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
    if (l.slice.replicated()) {
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
    if (s.slice.replicated()) continue;
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
