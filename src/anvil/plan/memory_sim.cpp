#include "anvil/plan/memory_sim.h"

#include <algorithm>

#include "anvil/core/error.h"

namespace anvil {

MemSim::Buf MemSim::alloc(MemCategory c, size_t bytes) {
  const size_t block = cached_block_bytes(bytes);
  if (block > 0) {
    requested_.insert(block);
    size_t& waiting = cached_[block];
    if (waiting > 0) --waiting;
    else reserved_ += block;
  } else {
    reserved_ += bytes;
  }
  peak_reserved_ = std::max(peak_reserved_, reserved_);
  const auto i = static_cast<size_t>(c);
  live_[i] += bytes;
  live_total_ += bytes;
  peak_[i] = std::max(peak_[i], live_[i]);
  peak_total_ = std::max(peak_total_, live_total_);
  std::weak_ptr<int> alive = alive_;
  return Buf(new char, [this, alive, c, bytes](const void* p) {
    delete static_cast<const char*>(p);
    if (!alive.expired()) free(c, bytes);
  });
}

void MemSim::free(MemCategory c, size_t bytes) {
  live_[static_cast<size_t>(c)] -= bytes;
  live_total_ -= bytes;
  const size_t block = cached_block_bytes(bytes);
  if (block > 0 && block <= kCachedBlockMax) ++cached_[block];
  else reserved_ -= block > 0 ? block : bytes;
}

void MemSim::trim_cache() {
  for (auto& [block, waiting] : cached_)
    if (!requested_.count(block)) {
      reserved_ -= waiting * block;
      waiting = 0;
    }
  requested_.clear();
}

void MemSim::release_cache() {
  for (auto& [block, waiting] : cached_) {
    reserved_ -= waiting * block;
    waiting = 0;
  }
}

ModelSim::ModelSim(MemSim& sim, const ModelSimShape& shape, std::vector<ModuleRange> stages, GroupHooksSim* hooks,
                   std::function<void()> ensure_grads)
    : sim_(sim),
      shape_(shape),
      tp_(shape.tp > 1),
      stages_(std::move(stages)),
      hooks_(hooks ? hooks : &no_hooks_),
      ensure_grads_(std::move(ensure_grads)) {
  const ModelArgs& a = shape.args;
  const auto tp = static_cast<size_t>(shape.tp);
  const size_t M = static_cast<size_t>(shape.B * shape.T);
  const size_t hd = static_cast<size_t>(a.head_dim());
  const size_t V = tp_ ? (static_cast<size_t>(a.vocab_size) + tp - 1) / tp : static_cast<size_t>(a.vocab_size);
  d_ = {M,
        tp_ && shape.sequence_parallel ? M / tp : M,
        static_cast<size_t>(a.dim),
        static_cast<size_t>(a.n_heads) / tp * hd,
        static_cast<size_t>(a.n_kv_heads) / tp * hd,
        static_cast<size_t>(a.ffn_hidden_dim()) / tp,
        V,
        dtype_size(shape.dtype),
        static_cast<size_t>(shape.B * shape.T) * static_cast<size_t>(a.n_heads) / tp * 4};
  for (const ModuleRange& r : stages_)
    for (int m = r.first; m < r.end; ++m) held_modules_.push_back(m);
}

size_t ModelSim::residual_bytes() const { return d_.Ml * d_.D * d_.e; }

int ModelSim::group_of_module(int module) const {
  const auto it = std::lower_bound(held_modules_.begin(), held_modules_.end(), module);
  ANVIL_ASSERT(it != held_modules_.end() && *it == module, "module ", module, " is not on this rank");
  return static_cast<int>(it - held_modules_.begin());
}

// ---- the tensor-parallel seams (dist/tensor_parallel.cpp; the base plan's without tp)

// comm_bytes (dist/comm.h) for a group of tp: all-reduce 2(n−1)/n·S, all-gather
// and reduce-scatter (n−1)/n·S.
void ModelSim::tp_all_reduce(uint64_t payload) {
  const auto n = static_cast<uint64_t>(shape_.tp);
  tp_bytes += 2 * (n - 1) * payload / n;
}
void ModelSim::tp_gather_or_scatter(uint64_t payload) {
  const auto n = static_cast<uint64_t>(shape_.tp);
  tp_bytes += (n - 1) * payload / n;
}

MemSim::Buf ModelSim::gather_rows(const MemSim::Buf& local, size_t cols, size_t elem) {
  if (!tp_ || !shape_.sequence_parallel) return local;
  tp_gather_or_scatter(d_.M * cols * elem);
  return sim_.act(d_.M * cols * elem);
}

MemSim::Buf ModelSim::reduce_partial(const MemSim::Buf& partial) {
  MemSim::Buf reduced = partial;
  if (shape_.sequence_parallel) tp_gather_or_scatter(d_.M * d_.D * 4);
  else tp_all_reduce(d_.M * d_.D * 4);
  if (shape_.sequence_parallel) reduced = sim_.act(d_.Ml * d_.D * 4);
  if (shape_.dtype == DType::f32) return reduced;
  return sim_.act(d_.Ml * d_.D * d_.e);
}

MemSim::Buf ModelSim::row_parallel_out() {
  if (!tp_) return sim_.act(d_.M * d_.D * d_.e);
  const MemSim::Buf partial = sim_.act(d_.M * d_.D * 4);  // f32 partial sums
  return reduce_partial(partial);
}

MemSim::Buf ModelSim::column_input_grad() { return row_parallel_out(); }  // the same buffers, in the same order

// ---- a transformer block (model/transformer_block.cpp)

// A block's RMSNorm: its output and rstd on this rank's rows, the output then
// gathered to every row for the column-parallel products that read it.
void ModelSim::rms_norm(MemSim::Buf& out, MemSim::Buf& rstd) {
  out = sim_.act(d_.Ml * d_.D * d_.e);
  rstd = sim_.act(d_.Ml * 4);
  out = gather_rows(out, d_.D, d_.e);
}

void ModelSim::run_forward(SimBlockSaved& s) {
  const Dims& d = d_;
  rms_norm(s.h1, s.rstd1);
  s.q = sim_.act(d.M * d.Dq * d.e);
  s.k = sim_.act(d.M * d.Dkv * d.e);
  s.v = sim_.act(d.M * d.Dkv * d.e);
  s.o = sim_.act(d.M * d.Dq * d.e);
  s.lse = sim_.act(d.lse);
  s.x2 = row_parallel_out();
  rms_norm(s.h2, s.rstd2);
  s.g = sim_.act(d.M * d.F * d.e);
  s.u = sim_.act(d.M * d.F * d.e);
  s.s = sim_.act(d.M * d.F * d.e);
}

MemSim::Buf ModelSim::block_forward(MemSim::Buf x, int layer, SimBlockSaved& s) {
  s = SimBlockSaved{};
  s.x = std::move(x);
  run_forward(s);
  MemSim::Buf out = row_parallel_out();
  if (shape_.ac.recomputes_whole_block(layer)) {
    SimBlockSaved kept;
    kept.x = s.x;
    s = kept;
  } else if (shape_.ac.mode == AcMode::selective_op) {
    s.h1 = s.rstd1 = s.h2 = s.rstd2 = s.s = nullptr;
  }
  return out;
}

void ModelSim::recompute(SimBlockSaved& s) {
  if (s.q && s.h1 && s.h2 && s.s) return;
  const Dims& d = d_;
  if (!s.q) {  // the whole forward again; its output is dropped at once
    run_forward(s);
    (void)row_parallel_out();
    return;
  }
  if (!s.h1) rms_norm(s.h1, s.rstd1);
  if (!s.h2) rms_norm(s.h2, s.rstd2);
  if (!s.s) s.s = sim_.act(d.M * d.F * d.e);
}

MemSim::Buf ModelSim::block_backward(SimBlockSaved& s, MemSim::Buf dout, bool split) {
  recompute(s);
  const Dims& d = d_;
  // A split backward defers dW += dyᵀ·x: it keeps dy (a copy when dy is dout's
  // own buffer, which the norm backwards overwrite) and x.
  auto weight_grad = [&](const MemSim::Buf& dy, const MemSim::Buf& x, size_t dy_bytes) {
    if (!split) return;
    s.weight_work.push_back(dy == dout ? sim_.act(dy_bytes) : dy);
    s.weight_work.push_back(x);
  };
  // Sequence parallelism sums the norms' weight gradients in a scratch.
  const MemSim::Buf norm_scratch =
      tp_ && shape_.sequence_parallel ? sim_.alloc(MemCategory::gradients, 2 * d.D * 4) : nullptr;
  if (norm_scratch) tp_all_reduce(2 * d.D * 4);  // both norms' weight gradients, at the end
  {  // feed-forward
    MemSim::Buf dout_full = gather_rows(dout, d.D, d.e);
    MemSim::Buf ds = sim_.act(d.M * d.F * d.e);
    weight_grad(dout_full, s.s, d.M * d.D * d.e);
    dout_full = nullptr;
    s.s = nullptr;
    ds = nullptr;
    MemSim::Buf dh2 = column_input_grad();
    weight_grad(s.g, s.h2, 0);
    weight_grad(s.u, s.h2, 0);
    s.g = s.u = s.h2 = nullptr;
    s.x2 = s.rstd2 = nullptr;
  }
  {  // attention
    MemSim::Buf dout_full = gather_rows(dout, d.D, d.e);
    MemSim::Buf dO = sim_.act(d.M * d.Dq * d.e);
    weight_grad(dout_full, s.o, d.M * d.D * d.e);
    dout_full = nullptr;
    MemSim::Buf dq = sim_.act(d.M * d.Dq * d.e);
    MemSim::Buf dk = sim_.act(d.M * d.Dkv * d.e);
    MemSim::Buf dv = sim_.act(d.M * d.Dkv * d.e);
    dO = nullptr;
    s.q = s.k = s.v = s.o = s.lse = nullptr;
    MemSim::Buf dh1 = column_input_grad();
    weight_grad(dq, s.h1, 0);
    weight_grad(dk, s.h1, 0);
    weight_grad(dv, s.h1, 0);
    s.h1 = nullptr;
  }
  std::vector<MemSim::Buf> work = std::move(s.weight_work);
  s = SimBlockSaved{};
  s.weight_work = std::move(work);
  return dout;
}

// ---- embedding and head (model/token_embedding.cpp, model/output_head.cpp)

MemSim::Buf ModelSim::embedding_forward() {
  MemSim::Buf partial = sim_.act(d_.M * d_.D * d_.e);
  if (!tp_) return partial;
  if (d_.Ml == d_.M) {
    tp_all_reduce(d_.M * d_.D * 4);
    return partial;
  }
  tp_gather_or_scatter(d_.M * d_.D * 4);
  return sim_.act(d_.Ml * d_.D * d_.e);
}

void ModelSim::embedding_backward(const MemSim::Buf& dh) { (void)gather_rows(dh, d_.D, d_.e); }

MemSim::Buf ModelSim::head_forward_backward(const MemSim::Buf& h) {
  const Dims& d = d_;
  MemSim::Buf dh = sim_.act(d.Ml * d.D * d.e);  // grad.residual
  MemSim::Buf hn = sim_.act(d.Ml * d.D * d.e);
  const MemSim::Buf rstd = sim_.act(d.Ml * 4);
  hn = gather_rows(hn, d.D, d.e);
  MemSim::Buf dhn;
  if (!tp_) {
    dhn = sim_.act(d.M * d.D * d.e);
  } else if (shape_.loss_parallel) {
    tp_all_reduce(d.M * 4);      // the rows' maxima
    tp_all_reduce(2 * d.M * 4);  // Σ exp and the target's logit
    const MemSim::Buf dx = sim_.act(d.M * d.D * 4);
    dhn = reduce_partial(dx);
  } else {  // every rank runs the whole head on the gathered output weight
    tp_gather_or_scatter(d.V * static_cast<size_t>(shape_.tp) * d.D * d.e);
    const MemSim::Buf full = sim_.alloc(MemCategory::communication, d.V * static_cast<size_t>(shape_.tp) * d.D * d.e);
    const MemSim::Buf dw_full =
        sim_.alloc(MemCategory::gradients, static_cast<size_t>(shape_.args.vocab_size) * d.D * 4);
    const MemSim::Buf dx = sim_.act(d.M * d.D * d.e);
    dhn = d.Ml == d.M ? dx : sim_.act(d.Ml * d.D * d.e);
  }
  hn = nullptr;
  const MemSim::Buf norm_scratch =
      tp_ && shape_.sequence_parallel ? sim_.alloc(MemCategory::gradients, d.D * 4) : nullptr;
  if (norm_scratch) tp_all_reduce(d.D * 4);
  (void)h;
  return dh;
}

MemSim::Buf ModelSim::logits(const SimStageSaved& saved) {
  ANVIL_ASSERT(saved.output != nullptr, "logits after the head's stage's forward");
  const int g = group_of_module(llama_num_modules(shape_.args) - 1);
  hooks_->before_forward(g);
  MemSim::Buf hn = sim_.act(d_.Ml * d_.D * d_.e);
  hn = gather_rows(hn, d_.D, d_.e);
  MemSim::Buf out = sim_.act(d_.M * d_.V * d_.e);
  hooks_->after_forward(g);
  return out;
}

// ---- the model's stages (model/llama.cpp)

MemSim::Buf ModelSim::forward(int stage, MemSim::Buf input, SimStageSaved& saved) {
  const ModuleRange& r = stages_.at(static_cast<size_t>(stage));
  const int last = llama_num_modules(shape_.args) - 1;
  saved = SimStageSaved{};
  MemSim::Buf h = std::move(input);
  if (r.first == 0) {
    const int g = group_of_module(0);
    hooks_->before_forward(g);
    h = embedding_forward();
    hooks_->after_forward(g);
  }
  for (int m = std::max(r.first, 1); m < std::min(r.end, last); ++m) {
    const int g = group_of_module(m);
    hooks_->before_forward(g);
    saved.blocks.emplace_back();
    h = block_forward(h, m - 1, saved.blocks.back());
    hooks_->after_forward(g);
  }
  if (r.end == last + 1) saved.output = h;
  return h;
}

MemSim::Buf ModelSim::backward_from_loss(int stage, SimStageSaved& saved, bool split) {
  const ModuleRange& r = stages_.at(static_cast<size_t>(stage));
  ANVIL_ASSERT(r.end == llama_num_modules(shape_.args) && saved.output, "the loss is the head's stage's");
  ensure_grads_();
  const int g = group_of_module(r.end - 1);
  hooks_->before_forward(g);
  hooks_->before_backward(g);
  MemSim::Buf dh = head_forward_backward(saved.output);
  hooks_->after_backward(g);
  saved.output = nullptr;
  return backward_blocks(stage, saved, std::move(dh), split);
}

MemSim::Buf ModelSim::backward(int stage, SimStageSaved& saved, MemSim::Buf d_output, bool split) {
  ensure_grads_();
  return backward_blocks(stage, saved, std::move(d_output), split);
}

MemSim::Buf ModelSim::backward_blocks(int stage, SimStageSaved& saved, MemSim::Buf dh, bool split) {
  const ModuleRange& r = stages_.at(static_cast<size_t>(stage));
  const int first_block = std::max(r.first, 1);
  for (size_t i = saved.blocks.size(); i-- > 0;) {
    const int g = group_of_module(first_block + static_cast<int>(i));
    hooks_->before_backward(g);
    dh = block_backward(saved.blocks[i], dh, split);
    if (!split) hooks_->after_backward(g);
  }
  if (!split) saved.blocks.clear();
  if (r.first != 0) return dh;
  if (split) {
    saved.d_embedding = dh;
  } else {
    const int g = group_of_module(0);
    hooks_->before_backward(g);
    embedding_backward(dh);
    hooks_->after_backward(g);
  }
  return nullptr;
}

void ModelSim::backward_weight(int stage, SimStageSaved& saved) {
  const ModuleRange& r = stages_.at(static_cast<size_t>(stage));
  const int first_block = std::max(r.first, 1);
  for (size_t i = saved.blocks.size(); i-- > 0;) {
    saved.blocks[i].weight_work.clear();
    hooks_->after_backward(group_of_module(first_block + static_cast<int>(i)));
  }
  saved.blocks.clear();
  if (r.first == 0) {
    const int g = group_of_module(0);
    hooks_->before_backward(g);
    embedding_backward(saved.d_embedding);
    hooks_->after_backward(g);
  }
  saved.d_embedding = nullptr;
}

}  // namespace anvil
