#include "anvil/model/llama.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>

#include "anvil/core/error.h"
#include "anvil/core/profiler.h"
#include "anvil/ops/attention.h"
#include "anvil/ops/embedding.h"
#include "anvil/ops/matmul.h"
#include "anvil/ops/rmsnorm.h"
#include "anvil/ops/swiglu.h"

namespace anvil {

namespace {

// Offsets of a block's parameters from its first one, in llama_param_specs' order.
enum BlockParam { kAttnNorm, kWq, kWk, kWv, kWo, kFfnNorm, kW1, kW3, kW2, kBlockParams };

Tensor activation(Shape shape, DType dt, const char* tag) {
  return Tensor::empty(std::move(shape), dt, MemCategory::activations, tag);
}

// y (M, N) += x (M, K) · w (N, K)ᵀ: the residual add folded into the product.
void linear_accumulate(const Tensor& x, const Tensor& w, Tensor& y) {
  GemmShape s{.M = x.size(0), .N = w.size(0), .K = x.size(1), .trans_b = true, .ab = x.dtype(), .c = y.dtype(),
              .accumulate = true};
  gemm(s, x.raw(), w.raw(), y.raw());
}

}  // namespace

AcPolicy parse_ac_policy(const std::string& mode, const std::string& option) {
  if (mode == "none") return {AcMode::none, 1};
  if (mode == "full") return {AcMode::full, 1};
  ANVIL_CHECK(mode == "selective", "activation_checkpoint.mode = \"", mode, "\" is not one of: none, selective, full");
  if (option == "op") return {AcMode::selective_op, 1};
  int k = 0;
  try {
    size_t used = 0;
    k = std::stoi(option, &used);
    if (used != option.size()) k = 0;
  } catch (const std::exception&) {
    k = 0;
  }
  ANVIL_CHECK(k >= 1, "activation_checkpoint.selective_ac_option = \"", option,
              "\" must be \"op\" or a positive integer k (checkpoint every k-th block)");
  return {AcMode::selective_layer, k};
}

const char* ac_mode_name(AcMode m) {
  switch (m) {
    case AcMode::none: return "none";
    case AcMode::selective_layer: return "selective layer";
    case AcMode::selective_op: return "selective op";
    case AcMode::full: return "full";
  }
  return "?";
}

std::vector<ParamSpec> llama_param_specs(const ModelArgs& a, int tp_rank, int tp_size) {
  const int64_t D = a.dim, hd = a.head_dim(), F = a.ffn_hidden_dim();
  const int64_t T = tp_size;
  ANVIL_ASSERT(T >= 1 && tp_rank >= 0 && tp_rank < T);
  ANVIL_CHECK(a.n_heads % T == 0 && a.n_kv_heads % T == 0, a.name, "/", a.flavor, ": ", T,
              " tensor-parallel ranks must divide n_heads ", a.n_heads, " and n_kv_heads ", a.n_kv_heads);
  ANVIL_CHECK(F % T == 0, a.name, "/", a.flavor, ": ", T, " tensor-parallel ranks must divide the feed-forward width ",
              F);
  // This rank's extents along the split dimension, and where its slice begins.
  const int64_t q_rows = a.n_heads / T * hd, kv_rows = a.n_kv_heads / T * hd, f_rows = F / T;
  const int64_t v_rows = padded_vocab_size(a.vocab_size, tp_size) / T;
  // Without tensor parallelism every parameter is whole (TpSlice's default).
  auto split = [&](int dim, int64_t extent, int64_t global) {
    return T == 1 ? TpSlice{} : TpSlice{dim, tp_rank * extent, global};
  };
  std::vector<ParamSpec> specs;
  auto add = [&](std::string name, Shape shape, ParamInit init, float std, int group, TpSlice tp) {
    ParamSpec s{std::move(name), std::move(shape), init, std, group};
    s.tp = tp;
    specs.push_back(std::move(s));
  };
  // Groups: 0 the embedding, 1 + l block l, n_layers + 1 the head.
  add("model.embed_tokens.weight", {v_rows, D}, ParamInit::normal, 1.0f, 0, split(0, v_rows, a.vocab_size));
  for (int64_t l = 0; l < a.n_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    // torchtitan's depth-scaled init for the projections that write into the residual stream.
    const float depth_std = 0.02f / std::sqrt(2.0f * static_cast<float>(l + 1));
    const int g = static_cast<int>(l) + 1;
    add(p + "input_layernorm.weight", {D}, ParamInit::ones, 0.02f, g, TpSlice{});
    add(p + "self_attn.q_proj.weight", {q_rows, D}, ParamInit::trunc_normal, 0.02f, g,
        split(0, q_rows, a.n_heads * hd));
    add(p + "self_attn.k_proj.weight", {kv_rows, D}, ParamInit::trunc_normal, 0.02f, g,
        split(0, kv_rows, a.n_kv_heads * hd));
    add(p + "self_attn.v_proj.weight", {kv_rows, D}, ParamInit::trunc_normal, 0.02f, g,
        split(0, kv_rows, a.n_kv_heads * hd));
    add(p + "self_attn.o_proj.weight", {D, q_rows}, ParamInit::trunc_normal, depth_std, g,
        split(1, q_rows, a.n_heads * hd));
    add(p + "post_attention_layernorm.weight", {D}, ParamInit::ones, 0.02f, g, TpSlice{});
    add(p + "mlp.gate_proj.weight", {f_rows, D}, ParamInit::trunc_normal, 0.02f, g, split(0, f_rows, F));
    add(p + "mlp.up_proj.weight", {f_rows, D}, ParamInit::trunc_normal, depth_std, g, split(0, f_rows, F));
    add(p + "mlp.down_proj.weight", {D, f_rows}, ParamInit::trunc_normal, depth_std, g, split(1, f_rows, F));
  }
  const int head = static_cast<int>(a.n_layers) + 1;
  add("model.norm.weight", {D}, ParamInit::ones, 0.02f, head, TpSlice{});
  if (!a.tie_embeddings)
    add("lm_head.weight", {v_rows, D}, ParamInit::trunc_normal, 1.0f / std::sqrt(static_cast<float>(D)), head,
        split(0, v_rows, a.vocab_size));
  return specs;
}

Llama::Llama(const ModelArgs& args, DType compute_dtype, int64_t max_seq_len, bool allocate_params,
             TensorParallel* tp)
    : args_(args),
      params_(llama_param_specs(args, tp ? tp->rank() : 0, tp ? tp->size() : 1), compute_dtype, allocate_params),
      tp_(tp) {
  args_.validate();
  const int64_t T = tp ? tp->size() : 1;
  heads_ = args.n_heads / T;
  kv_heads_ = args.n_kv_heads / T;
  ffn_ = args.ffn_hidden_dim() / T;
  const int64_t v_rows = padded_vocab_size(args.vocab_size, static_cast<int>(T)) / T;
  vocab_begin_ = (tp ? tp->rank() : 0) * v_rows;
  vocab_rows_ = std::clamp<int64_t>(args.vocab_size - vocab_begin_, 0, v_rows);
  rope_ = rope_table(max_seq_len, args.head_dim(), args.rope_theta, args.rope_scaling);
  embed_index_ = params_.index_of("model.embed_tokens.weight");
  norm_index_ = params_.index_of("model.norm.weight");
  output_index_ = args.tie_embeddings ? embed_index_ : params_.index_of("lm_head.weight");
  for (int64_t l = 0; l < args.n_layers; ++l)
    block_first_index_.push_back(params_.index_of("model.layers." + std::to_string(l) + ".input_layernorm.weight"));
}

BlockParams Llama::block_compute(int layer) const {
  const int i = block_first_index_[static_cast<size_t>(layer)];
  auto p = [&](int k) { return params_.compute(i + k); };
  return {p(kAttnNorm), p(kWq), p(kWk), p(kWv), p(kWo), p(kFfnNorm), p(kW1), p(kW2), p(kW3)};
}

BlockParams Llama::block_grads(int layer) const {
  const int i = block_first_index_[static_cast<size_t>(layer)];
  auto p = [&](int k) { return params_.grad(i + k); };
  return {p(kAttnNorm), p(kWq), p(kWk), p(kWv), p(kWo), p(kFfnNorm), p(kW1), p(kW2), p(kW3)};
}

// ---- tensor-parallel seams ----
//
// Megatron's layout (Shoeybi et al. 2019; sequence parallelism: Korthikanti et al. 2022).
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

int64_t Llama::residual_rows(int64_t M) const {
  if (tp_ == nullptr || !tp_->sequence_parallel()) return M;
  ANVIL_CHECK(M % tp_->size() == 0, "sequence parallelism splits the ", M,
              " tokens of a micro-batch (batch x sequence length) over ", tp_->size(),
              " tensor-parallel ranks, which must divide them");
  return M / tp_->size();
}

Tensor Llama::gather_rows(const Tensor& local, const char* tag) const {
  if (tp_ == nullptr || !tp_->sequence_parallel()) return local;
  Tensor full = activation({local.size(0) * tp_->size(), local.size(1)}, local.dtype(), tag);
  tp_->all_gather(local, full);
  return full;
}

Tensor Llama::row_parallel_out(const Tensor& residual, const Tensor& in, const Tensor& w, const char* tag) const {
  const DType dt = compute_dtype();
  const int64_t M = in.size(0), D = w.size(0);
  if (tp_ == nullptr) {
    Tensor out = activation({M, D}, dt, tag);
    out.copy_from(residual);
    linear_accumulate(in, w, out);
    return out;
  }
  const int64_t Ml = residual_rows(M), r = tp_->rank();
  const bool sp = tp_->sequence_parallel();
  // The residual enters the sum once: on every rank's own rows (SP) or on rank 0 only.
  const char* partial_tag = sp || dt != DType::f32 ? "tp.partial" : tag;  // non-SP f32: it is the output
  Tensor partial = Tensor::empty({M, D}, DType::f32, MemCategory::activations, partial_tag);
  if (sp) {
    for (int64_t q = 0; q < tp_->size(); ++q) {
      Tensor rows = partial.slice(q * Ml, Ml);
      if (q == r) rows.copy_from(residual);
      else rows.zero_();
    }
  } else if (r == 0) {
    partial.copy_from(residual);
  } else {
    partial.zero_();
  }
  linear_accumulate(in, w, partial);  // (M, D) += in (M, K_t) · w (D, K_t)ᵀ
  return reduce_input_grad(partial, tag);  // the same reduction, and one rounding
}

Tensor Llama::reduce_input_grad(const Tensor& partial, const char* tag) const {
  ANVIL_ASSERT(tp_ != nullptr && partial.dtype() == DType::f32);
  const DType dt = compute_dtype();
  const int64_t M = partial.size(0), D = partial.size(1), Ml = residual_rows(M);
  Tensor reduced = partial;
  if (tp_->sequence_parallel()) {
    reduced = Tensor::empty({Ml, D}, DType::f32, MemCategory::activations, dt == DType::f32 ? tag : "tp.partial_rows");
    tp_->reduce_scatter(partial, reduced);
  } else {
    tp_->all_reduce_sum(partial);
  }
  if (dt == DType::f32) return reduced;
  Tensor out = activation({Ml, D}, dt, tag);
  out.copy_from(reduced);
  return out;
}

Tensor Llama::gather_output_weight() const {
  const Tensor local = params_.compute(output_index_);
  Tensor full = Tensor::empty({local.size(0) * tp_->size(), local.size(1)}, local.dtype(), MemCategory::communication,
                              "tp.output_weight");
  tp_->all_gather(local, full);
  return full;
}

CrossEntropyResult Llama::loss_parallel_lse(const Tensor& hn, const Tensor& w, const Tensor& targets,
                                            Tensor& lse) const {
  const int64_t M = hn.size(0);
  // stats (3, M): this shard's row max, Σ exp(logit − max), target logit.
  Tensor stats = Tensor::empty({3, M}, DType::f32, MemCategory::workspace, "loss_parallel.stats");
  cross_entropy_shard_stats(hn, w, targets, vocab_begin_, args_.vocab_size, stats);
  Tensor global_max = Tensor::empty({M}, DType::f32, MemCategory::workspace, "loss_parallel.max");
  global_max.copy_from(stats.slice(0, 1));
  tp_->all_reduce_max(global_max);
  cross_entropy_rescale_sumexp(stats, global_max, targets);
  tp_->all_reduce_sum(stats.slice(1, 2));  // Σ exp(logit − max) and the target's logit, over the shards
  return cross_entropy_combine_rows(global_max, stats, targets, lse);
}

CrossEntropyResult Llama::head_tp_forward_backward(const Tensor& hn, const Tensor& targets, float grad_scale,
                                                   Tensor& dhn) {
  const int64_t M = hn.size(0), D = args_.dim, V = args_.vocab_size;
  // This rank's real vocabulary rows: the padding takes no part in the softmax.
  Tensor dw = params_.grad(output_index_).slice(0, vocab_rows_);
  if (tp_->loss_parallel()) {
    const Tensor w = params_.compute(output_index_).slice(0, vocab_rows_);
    Tensor lse = Tensor::empty({M}, DType::f32, MemCategory::workspace, "loss_parallel.lse");
    const CrossEntropyResult loss = loss_parallel_lse(hn, w, targets, lse);
    // dx = Σ_t dlogits_t · w_t: this rank's term, summed over tp like a row-parallel output.
    Tensor dx = Tensor::empty({M, D}, DType::f32, MemCategory::activations, "tp.partial");
    cross_entropy_shard_backward(hn, w, targets, vocab_begin_, lse, grad_scale, dx, dw);
    dhn = reduce_input_grad(dx, "final_norm.dout");
    return loss;
  }
  // Loss parallel off: every rank runs the whole head on the gathered weight (the same
  // numbers as gathering the logits, without ever holding them), keeps its rows of dW and
  // its rows of dX, which every rank computed alike.
  const Tensor full = gather_output_weight();
  Tensor dw_full = Tensor::zeros({V, D}, DType::f32, MemCategory::gradients, "tp.output_grad");
  Tensor dx = activation({M, D}, compute_dtype(), "final_norm.dout");
  const CrossEntropyResult loss =
      cross_entropy_forward_backward(hn, full.slice(0, V), targets, grad_scale, dx, dw_full);
  const float* src = dw_full.data<float>() + vocab_begin_ * D;
  float* dst = dw.data<float>();
  for (int64_t i = 0; i < vocab_rows_ * D; ++i) dst[i] += src[i];
  const int64_t Ml = residual_rows(M);
  if (Ml == M) {
    dhn = dx;
  } else {
    dhn = activation({Ml, D}, compute_dtype(), "final_norm.dout");
    dhn.copy_from(dx.slice(tp_->rank() * Ml, Ml));
  }
  return loss;
}

CrossEntropyResult Llama::head_tp_forward(const Tensor& hn, const Tensor& targets) const {
  if (tp_->loss_parallel()) {
    Tensor lse = Tensor::empty({hn.size(0)}, DType::f32, MemCategory::workspace, "loss_parallel.lse");
    return loss_parallel_lse(hn, params_.compute(output_index_).slice(0, vocab_rows_), targets, lse);
  }
  return cross_entropy_forward(hn, gather_output_weight().slice(0, args_.vocab_size), targets);
}

// ---- the model ----

Tensor Llama::embed(const Tensor& tokens) const {
  if (tp_ == nullptr) {
    Tensor h = activation({tokens.numel(), args_.dim}, compute_dtype(), "embed.out");
    embedding_forward(tokens, params_.compute(embed_index_), h);
    return h;
  }
  // Vocabulary-parallel: each rank looks up the ids in its range (zero rows for the rest);
  // the sum over tp is the lookup, exactly (one nonzero term per row).
  const int64_t M = tokens.numel(), Ml = residual_rows(M);
  Tensor partial = activation({M, args_.dim}, compute_dtype(), Ml == M ? "embed.out" : "embed.partial");
  embedding_forward_shard(tokens, params_.compute(embed_index_), vocab_begin_, args_.vocab_size, partial);
  if (Ml == M) {
    tp_->all_reduce_sum(partial);
    return partial;
  }
  Tensor h = activation({Ml, args_.dim}, compute_dtype(), "embed.out");
  tp_->reduce_scatter(partial, h);
  return h;
}

Tensor Llama::block_forward(int layer, BlockSaved& s, int64_t B, int64_t T, bool recomputing) const {
  const BlockParams p = block_compute(layer);
  const DType dt = compute_dtype();
  // Hq, Hkv, F: this rank's heads and feed-forward columns (all of them without tensor parallelism).
  const int64_t M = B * T, Ml = residual_rows(M), D = args_.dim, hd = args_.head_dim(), Hq = heads_, Hkv = kv_heads_;
  const int64_t F = ffn_;
  const float eps = static_cast<float>(args_.norm_eps);

  const SpanCategory cat = recomputing ? SpanCategory::recompute : SpanCategory::forward;
  // Attention: h1 = norm(x); q, k, v = h1·W{q,k,v}ᵀ; RoPE; o = attention; x2 = x + o·Woᵀ
  std::optional<ScopedPhase> phase;
  phase.emplace(cat, recomputing ? "attention.recompute" : "attention.forward", layer);
  s.h1 = activation({Ml, D}, dt, "block.h1");
  s.rstd1 = activation({Ml}, DType::f32, "block.rstd1");
  rmsnorm_forward(s.x, p.attention_norm, eps, s.h1, s.rstd1);
  s.h1 = gather_rows(s.h1, "block.h1");
  s.q = activation({B, T, Hq, hd}, dt, "block.q");
  s.k = activation({B, T, Hkv, hd}, dt, "block.k");
  s.v = activation({B, T, Hkv, hd}, dt, "block.v");
  Tensor q2 = s.q.view({M, Hq * hd}), k2 = s.k.view({M, Hkv * hd}), v2 = s.v.view({M, Hkv * hd});
  linear_forward(s.h1, p.wq, q2);
  linear_forward(s.h1, p.wk, k2);
  linear_forward(s.h1, p.wv, v2);
  rope_forward(s.q, rope_, 0, s.q);
  rope_forward(s.k, rope_, 0, s.k);
  s.o = activation({B, T, Hq, hd}, dt, "block.o");
  s.lse = activation({B, Hq, T}, DType::f32, "block.lse");
  attention_forward(s.q, s.k, s.v, s.o, s.lse);
  s.x2 = row_parallel_out(s.x, s.o.view({M, Hq * hd}), p.wo, "block.x2");

  // Feed-forward: h2 = norm(x2); out = x2 + (silu(h2·W1ᵀ) ⊙ h2·W3ᵀ)·W2ᵀ
  phase.reset();
  phase.emplace(cat, recomputing ? "feed_forward.recompute" : "feed_forward.forward", layer);
  s.h2 = activation({Ml, D}, dt, "block.h2");
  s.rstd2 = activation({Ml}, DType::f32, "block.rstd2");
  rmsnorm_forward(s.x2, p.ffn_norm, eps, s.h2, s.rstd2);
  s.h2 = gather_rows(s.h2, "block.h2");
  s.g = activation({M, F}, dt, "block.g");
  s.u = activation({M, F}, dt, "block.u");
  linear_forward(s.h2, p.w1, s.g);
  linear_forward(s.h2, p.w3, s.u);
  s.s = activation({M, F}, dt, "block.s");
  swiglu_forward(s.g, s.u, s.s);
  return row_parallel_out(s.x2, s.s, p.w2, "block.out");
}

void Llama::drop_unkept(int layer, BlockSaved& s, const AcPolicy& policy) const {
  const bool whole_block = policy.mode == AcMode::full ||
                           (policy.mode == AcMode::selective_layer && layer % policy.every == 0);
  if (whole_block) {
    Tensor x = s.x;
    s = BlockSaved{};
    s.x = x;
  } else if (policy.mode == AcMode::selective_op) {
    // Keep matmul and attention outputs; the norms and SwiGLU are cheap to redo.
    s.h1 = s.rstd1 = s.h2 = s.rstd2 = s.s = Tensor();
  }
}

void Llama::recompute(int layer, BlockSaved& s, int64_t B, int64_t T) const {
  if (s.q.defined() && s.h1.defined() && s.h2.defined() && s.s.defined()) return;  // everything was kept
  const ScopedPhase phase(SpanCategory::recompute, "recompute", layer);
  if (!s.q.defined()) {  // only the input was kept: run the whole block again
    block_forward(layer, s, B, T, /*recomputing=*/true);
    return;
  }
  const BlockParams p = block_compute(layer);
  const DType dt = compute_dtype();
  const int64_t M = B * T, Ml = residual_rows(M), D = args_.dim, F = ffn_;
  const float eps = static_cast<float>(args_.norm_eps);
  if (!s.h1.defined()) {
    s.h1 = activation({Ml, D}, dt, "block.h1");
    s.rstd1 = activation({Ml}, DType::f32, "block.rstd1");
    rmsnorm_forward(s.x, p.attention_norm, eps, s.h1, s.rstd1);
    s.h1 = gather_rows(s.h1, "block.h1");
  }
  if (!s.h2.defined()) {
    s.h2 = activation({Ml, D}, dt, "block.h2");
    s.rstd2 = activation({Ml}, DType::f32, "block.rstd2");
    rmsnorm_forward(s.x2, p.ffn_norm, eps, s.h2, s.rstd2);
    s.h2 = gather_rows(s.h2, "block.h2");
  }
  if (!s.s.defined()) {
    s.s = activation({M, F}, dt, "block.s");
    swiglu_forward(s.g, s.u, s.s);
  }
}

namespace {
// dst (D) f32 += src (D) f32
void add_into(const Tensor& src, Tensor dst) {
  const float* a = src.data<float>();
  float* b = dst.data<float>();
  for (int64_t i = 0; i < dst.numel(); ++i) b[i] += a[i];
}
}  // namespace

Tensor Llama::block_backward(int layer, BlockSaved& s, Tensor dout, int64_t B, int64_t T) {
  recompute(layer, s, B, T);
  const BlockParams p = block_compute(layer);
  BlockParams gp = block_grads(layer);
  const DType dt = compute_dtype();
  const int64_t M = B * T, D = args_.dim, hd = args_.head_dim(), Hq = heads_, Hkv = kv_heads_;
  const int64_t F = ffn_;
  const float eps = static_cast<float>(args_.norm_eps);
  // dout (M_l, D): gradient of the block output; it becomes dx2, then dx, in place.

  // Under sequence parallelism each rank's norm-weight gradients cover its rows only: they
  // are gathered in a scratch pair, summed over tp, then added to the gradients (adding the
  // sum into the gradients directly would also re-sum earlier micro-batches' accumulation).
  Tensor norm_grads;  // (2, D) f32: the ffn norm's, the attention norm's
  Tensor g_ffn_norm = gp.ffn_norm, g_attention_norm = gp.attention_norm;
  if (tp_ != nullptr && tp_->sequence_parallel()) {
    norm_grads = Tensor::zeros({2, D}, DType::f32, MemCategory::gradients, "tp.norm_grads");
    g_ffn_norm = norm_grads.slice(0, 1).view({D});
    g_attention_norm = norm_grads.slice(1, 1).view({D});
  }

  // Feed-forward, in reverse.
  {
    const ScopedPhase phase(SpanCategory::backward, "feed_forward.backward", layer);
    Tensor dout_full = gather_rows(dout, "block.dout");  // (M, D)
    Tensor ds = activation({M, F}, dt, "block.ds");
    linear_backward_input(dout_full, p.w2, ds);
    linear_backward_weight(dout_full, s.s, gp.w2);
    dout_full = Tensor();
    s.s = Tensor();
    // dg and du overwrite g and u: they are not needed after this.
    swiglu_backward(ds, s.g, s.u, s.g, s.u);
    ds = Tensor();
    Tensor dh2;  // (M_l, D)
    if (tp_ == nullptr) {
      dh2 = activation({M, D}, dt, "block.dh2");
      linear_backward_input(s.g, p.w1, dh2);
      linear_backward_input(s.u, p.w3, dh2, /*accumulate_dx=*/true);
    } else {
      Tensor partial = Tensor::empty({M, D}, DType::f32, MemCategory::activations, "tp.partial");
      linear_backward_input(s.g, p.w1, partial);
      linear_backward_input(s.u, p.w3, partial, /*accumulate_dx=*/true);
      dh2 = reduce_input_grad(partial, "block.dh2");
    }
    linear_backward_weight(s.g, s.h2, gp.w1);
    linear_backward_weight(s.u, s.h2, gp.w3);
    s.g = s.u = s.h2 = Tensor();
    rmsnorm_backward(dh2, s.x2, p.ffn_norm, s.rstd2, eps, dout, g_ffn_norm, /*accumulate_dx=*/true);
    s.x2 = s.rstd2 = Tensor();
  }
  // Attention, in reverse.
  {
    const ScopedPhase phase(SpanCategory::backward, "attention.backward", layer);
    Tensor dout_full = gather_rows(dout, "block.dout");  // (M, D)
    Tensor dO = activation({B, T, Hq, hd}, dt, "block.do");
    Tensor dO2 = dO.view({M, Hq * hd});
    linear_backward_input(dout_full, p.wo, dO2);
    linear_backward_weight(dout_full, s.o.view({M, Hq * hd}), gp.wo);
    dout_full = Tensor();
    Tensor dq = activation({B, T, Hq, hd}, dt, "block.dq");
    Tensor dk = activation({B, T, Hkv, hd}, dt, "block.dk");
    Tensor dv = activation({B, T, Hkv, hd}, dt, "block.dv");
    attention_backward(dO, s.q, s.k, s.v, s.o, s.lse, dq, dk, dv);
    dO = dO2 = Tensor();
    s.q = s.k = s.v = s.o = s.lse = Tensor();
    rope_backward(dq, rope_, 0, dq);
    rope_backward(dk, rope_, 0, dk);
    const Tensor dq2 = dq.view({M, Hq * hd}), dk2 = dk.view({M, Hkv * hd}), dv2 = dv.view({M, Hkv * hd});
    Tensor dh1;  // (M_l, D)
    if (tp_ == nullptr) {
      dh1 = activation({M, D}, dt, "block.dh1");
      linear_backward_input(dq2, p.wq, dh1);
      linear_backward_input(dk2, p.wk, dh1, true);
      linear_backward_input(dv2, p.wv, dh1, true);
    } else {
      Tensor partial = Tensor::empty({M, D}, DType::f32, MemCategory::activations, "tp.partial");
      linear_backward_input(dq2, p.wq, partial);
      linear_backward_input(dk2, p.wk, partial, true);
      linear_backward_input(dv2, p.wv, partial, true);
      dh1 = reduce_input_grad(partial, "block.dh1");
    }
    linear_backward_weight(dq2, s.h1, gp.wq);
    linear_backward_weight(dk2, s.h1, gp.wk);
    linear_backward_weight(dv2, s.h1, gp.wv);
    s.h1 = Tensor();
    rmsnorm_backward(dh1, s.x, p.attention_norm, s.rstd1, eps, dout, g_attention_norm, /*accumulate_dx=*/true);
  }
  if (norm_grads.defined()) {
    tp_->all_reduce_sum(norm_grads);
    add_into(norm_grads.slice(0, 1), gp.ffn_norm);
    add_into(norm_grads.slice(1, 1), gp.attention_norm);
  }
  s = BlockSaved{};
  return dout;
}

CrossEntropyResult Llama::forward_backward(const Tensor& tokens, const Tensor& targets, float grad_scale,
                                           const AcPolicy& policy) {
  ANVIL_ASSERT(tokens.ndim() == 2 && targets.shape() == tokens.shape(), "tokens ", shape_str(tokens.shape()),
               " targets ", shape_str(targets.shape()));
  const int64_t B = tokens.size(0), T = tokens.size(1), M = B * T, D = args_.dim;
  ANVIL_CHECK(T <= rope_.max_positions(), "sequence length ", T, " exceeds the model's maximum ",
              rope_.max_positions());
  const int64_t Ml = residual_rows(M);
  const DType dt = compute_dtype();
  const float eps = static_cast<float>(args_.norm_eps);

  std::vector<BlockSaved> saved(static_cast<size_t>(args_.n_layers));
  const int head = head_group();
  Tensor h;
  {
    const ScopedPhase phase(SpanCategory::forward, "embedding.forward");
    hooks_->before_forward(0);
    h = embed(tokens);
    hooks_->after_forward(0);
  }
  for (int l = 0; l < args_.n_layers; ++l) {
    const ScopedPhase phase(SpanCategory::forward, "forward", l);
    hooks_->before_forward(l + 1);
    saved[static_cast<size_t>(l)].x = h;
    h = block_forward(l, saved[static_cast<size_t>(l)], B, T);
    drop_unkept(l, saved[static_cast<size_t>(l)], policy);
    hooks_->after_forward(l + 1);
  }

  CrossEntropyResult loss;
  Tensor dh;
  {
    // The final norm, output projection and cross-entropy, forward and backward fused.
    const ScopedPhase phase(SpanCategory::loss, "loss");
    params_.ensure_grads();  // the backward starts here
    hooks_->before_forward(head);
    hooks_->before_backward(head);
    dh = activation({Ml, D}, dt, "grad.residual");
    Tensor hn = activation({Ml, D}, dt, "final_norm.out");
    Tensor rstd = activation({Ml}, DType::f32, "final_norm.rstd");
    rmsnorm_forward(h, params_.compute(norm_index_), eps, hn, rstd);
    hn = gather_rows(hn, "final_norm.out");  // the head sees every row
    Tensor dhn;
    if (tp_ == nullptr) {
      dhn = activation({M, D}, dt, "final_norm.dout");
      Tensor dw_out = params_.grad(output_index_);
      loss = cross_entropy_forward_backward(hn, params_.compute(output_index_), targets.view({M}), grad_scale, dhn,
                                            dw_out);
    } else {
      loss = head_tp_forward_backward(hn, targets.view({M}), grad_scale, dhn);
    }
    hn = Tensor();
    Tensor gnorm = params_.grad(norm_index_);
    Tensor norm_grad;  // sequence parallel: this rank's rows' part, summed over tp below
    if (tp_ != nullptr && tp_->sequence_parallel())
      norm_grad = Tensor::zeros({D}, DType::f32, MemCategory::gradients, "tp.norm_grads");
    rmsnorm_backward(dhn, h, params_.compute(norm_index_), rstd, eps, dh, norm_grad.defined() ? norm_grad : gnorm);
    if (norm_grad.defined()) {
      tp_->all_reduce_sum(norm_grad);
      add_into(norm_grad, gnorm);
    }
    gnorm = Tensor();  // the hook may free the group's buffers
    hooks_->after_backward(head);
  }
  h = Tensor();
  for (int l = args_.n_layers - 1; l >= 0; --l) {
    const ScopedPhase phase(SpanCategory::backward, "backward", l);
    hooks_->before_backward(l + 1);
    dh = block_backward(l, saved[static_cast<size_t>(l)], dh, B, T);
    saved[static_cast<size_t>(l)] = BlockSaved{};
    hooks_->after_backward(l + 1);
  }
  const ScopedPhase phase(SpanCategory::backward, "embedding.backward");
  hooks_->before_backward(0);
  Tensor g_embed = params_.grad(embed_index_);
  if (tp_ == nullptr) {
    embedding_backward(dh, tokens, g_embed);
  } else {
    dh = gather_rows(dh, "embed.dout");
    embedding_backward_shard(dh, tokens, vocab_begin_, args_.vocab_size, g_embed);
  }
  g_embed = Tensor();
  hooks_->after_backward(0);
  return loss;
}

CrossEntropyResult Llama::forward(const Tensor& tokens, const Tensor& targets) {
  const int64_t B = tokens.size(0), T = tokens.size(1), M = B * T, D = args_.dim;
  ANVIL_CHECK(T <= rope_.max_positions(), "sequence length ", T, " exceeds the model's maximum ",
              rope_.max_positions());
  const int64_t Ml = residual_rows(M);
  hooks_->before_forward(0);
  Tensor h = embed(tokens);
  hooks_->after_forward(0);
  for (int l = 0; l < args_.n_layers; ++l) {
    hooks_->before_forward(l + 1);
    BlockSaved s;
    s.x = h;
    h = block_forward(l, s, B, T);
    hooks_->after_forward(l + 1);
  }
  const int head = head_group();
  hooks_->before_forward(head);
  Tensor hn = activation({Ml, D}, compute_dtype(), "final_norm.out");
  rmsnorm_forward(h, params_.compute(norm_index_), static_cast<float>(args_.norm_eps), hn);
  hn = gather_rows(hn, "final_norm.out");
  const CrossEntropyResult r = tp_ == nullptr
                                   ? cross_entropy_forward(hn, params_.compute(output_index_), targets.view({M}))
                                   : head_tp_forward(hn, targets.view({M}));
  hooks_->after_forward(head);
  return r;
}

}  // namespace anvil
