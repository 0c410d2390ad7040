#include "anvil/model/transformer_block.h"

#include <algorithm>
#include <optional>

#include "anvil/core/error.h"
#include "anvil/core/profiler.h"
#include "anvil/ops/attention.h"
#include "anvil/ops/matmul.h"
#include "anvil/ops/rmsnorm.h"
#include "anvil/ops/rope.h"
#include "anvil/ops/swiglu.h"

namespace anvil {

namespace {
// Offsets of a block's parameters from its first one, in llama_param_specs'
// order. A MoE block has the router at kW1 and then its E experts' gate, up
// and down projections; the q/k norms follow the feed-forward's parameters.
enum BlockParam { kAttnNorm, kWq, kWk, kWv, kWo, kFfnNorm, kW1, kW3, kW2, kDenseQNorm };
constexpr int kRouter = kW1;
}  // namespace

TransformerBlock::TransformerBlock(ParamStore& params, int first_param, int layer, const ModelArgs& args,
                                   const RopeTable& rope, const ParallelStyle& style, MoeStepState* moe_state,
                                   ExpertExchange* exchange)
    : params_(params),
      first_param_(first_param),
      layer_(layer),
      dim_(args.dim),
      head_dim_(args.head_dim()),
      qk_norm_(args.qk_norm),
      router_{args.moe() ? args.experts_per_token : 0, args.norm_topk_prob, args.moe_balanced_routing},
      local_experts_(args.moe() ? static_cast<int>(args.num_experts / (exchange ? exchange->size() : 1)) : 0),
      moe_state_(moe_state),
      exchange_(exchange),
      eps_(static_cast<float>(args.norm_eps)),
      rope_(rope),
      style_(style) {
  const std::vector<ParamSpec>& specs = params.specs();
  heads_ = specs[static_cast<size_t>(first_param + kWq)].shape[0] / head_dim_;
  kv_heads_ = specs[static_cast<size_t>(first_param + kWk)].shape[0] / head_dim_;
  ffn_ = args.moe() ? args.moe_ffn_hidden : specs[static_cast<size_t>(first_param + kW1)].shape[0];
  q_norm_param_ = args.moe() ? kRouter + 1 + 3 * local_experts_ : kDenseQNorm;
  ANVIL_ASSERT(!args.moe() || moe_state != nullptr, "a mixture-of-experts block reports to its model's step state");
  if (args.moe()) {
    router_.sigmoid = args.moe_sigmoid_scores;
    // The layer's row of the model's expert biases (sized before any block is built).
    if (args.moe_bias_update_rate > 0) {
      ANVIL_ASSERT(static_cast<int64_t>(moe_state->expert_bias.size()) == args.n_layers * args.num_experts);
      router_.bias = moe_state->expert_bias.data() + static_cast<int64_t>(layer) * args.num_experts;
    }
  }
}

namespace {
// A block's parameters through `one` (parameter i) and `stack` (count
// parameters from i as one tensor): the compute copies or the gradients.
template <class One, class Stack>
BlockParams block_params(One one, Stack stack, bool moe, int experts, int q_norm, bool qk_norm) {
  BlockParams b{one(kAttnNorm), one(kWq), one(kWk), one(kWv), one(kWo), one(kFfnNorm), {}, {}, {}, {}, {}, {}};
  if (moe) {
    const int E = experts;
    b.moe = {one(kRouter), stack(kRouter + 1, E), stack(kRouter + 1 + E, E), stack(kRouter + 1 + 2 * E, E)};
  } else {
    b.w1 = one(kW1), b.w2 = one(kW2), b.w3 = one(kW3);
  }
  if (qk_norm) b.q_norm = one(q_norm), b.k_norm = one(q_norm + 1);
  return b;
}
}  // namespace

BlockParams TransformerBlock::compute_params() const {
  return block_params([&](int k) { return params_.compute(first_param_ + k); },
                      [&](int k, int n) { return params_.compute_stack(first_param_ + k, n); }, router_.top_k > 0,
                      local_experts_, q_norm_param_, qk_norm_);
}

BlockParams TransformerBlock::grad_params() const {
  return block_params([&](int k) { return params_.grad(first_param_ + k); },
                      [&](int k, int n) { return params_.grad_stack(first_param_ + k, n); }, router_.top_k > 0,
                      local_experts_, q_norm_param_, qk_norm_);
}

void TransformerBlock::project_heads(const Tensor& h1, const Tensor& w, const Tensor& norm, Tensor& out, Tensor& raw,
                                     Tensor& rstd, bool keys) const {
  const int64_t M = h1.size(0), H = out.size(2), hd = head_dim_;
  if (!qk_norm_) {
    Tensor out2 = out.view({M, H * hd});
    linear_forward(h1, w, out2);
    return;
  }
  raw = new_activation(out.shape(), out.dtype(), keys ? "block.k_raw" : "block.q_raw");
  rstd = new_activation({M * H}, DType::f32, keys ? "block.rstd_k" : "block.rstd_q");
  Tensor raw2 = raw.view({M, H * hd}), out_rows = out.view({M * H, hd});
  linear_forward(h1, w, raw2);
  rmsnorm_forward(raw.view({M * H, hd}), norm, eps_, out_rows, rstd);
}

Tensor TransformerBlock::forward(const Tensor& x, int64_t B, int64_t T, const AcPolicy& policy, BlockSaved& saved,
                                 const Tensor& documents) const {
  saved = BlockSaved{};
  saved.B = B, saved.T = T;
  saved.documents = documents;
  saved.x = x;
  Tensor out = run_forward(saved, /*recomputing=*/false);
  report_routing(saved);
  drop_unkept(saved, policy);
  return out;
}

Tensor TransformerBlock::forward(const Tensor& x, int64_t B, int64_t T, const Tensor& documents) const {
  BlockSaved s;
  s.B = B, s.T = T;
  s.documents = documents;
  s.x = x;
  return run_forward(s, /*recomputing=*/false);
}

Tensor TransformerBlock::forward_cached(const Tensor& x, int64_t T, const std::vector<int64_t>& slots,
                                        const std::vector<int64_t>& positions, Tensor& cache_k, Tensor& cache_v) const {
  const BlockParams p = compute_params();
  const DType dt = params_.compute_dtype();
  const int64_t B = static_cast<int64_t>(slots.size()), M = B * T, D = dim_, hd = head_dim_, Hq = heads_,
                Hkv = kv_heads_, capacity = cache_k.size(1);
  ANVIL_ASSERT(style_.residual_rows(M) == M, "a key/value cache runs on a single process");
  ANVIL_ASSERT(positions.size() == slots.size() && x.size(0) == M, "x ", shape_str(x.shape()), " for ", B,
               " sequences of ", T, " tokens");
  BlockSaved s;
  s.B = B, s.T = T;
  s.x = x;
  {
    const ScopedPhase phase(SpanCategory::forward, "attention.cached", layer_);
    Tensor h1 = new_activation({M, D}, dt, "block.h1"), rstd1 = new_activation({M}, DType::f32, "block.rstd1");
    rmsnorm_forward(x, p.attention_norm, eps_, h1, rstd1);
    Tensor q = new_activation({B, T, Hq, hd}, dt, "block.q"), k = new_activation({B, T, Hkv, hd}, dt, "block.k"),
           v = new_activation({B, T, Hkv, hd}, dt, "block.v");
    Tensor v2 = v.view({M, Hkv * hd}), q_raw, k_raw, rstd_q, rstd_k;
    project_heads(h1, p.wq, p.q_norm, q, q_raw, rstd_q, /*keys=*/false);
    project_heads(h1, p.wk, p.k_norm, k, k_raw, rstd_k, /*keys=*/true);
    linear_forward(h1, p.wv, v2);
    q_raw = k_raw = rstd_q = rstd_k = Tensor();
    Tensor o = new_activation({B, T, Hq, hd}, dt, "block.o");
    Tensor lse = new_activation({1, Hq, T}, DType::f32, "block.lse");
    // Each sequence at its own position: its new keys and values join its
    // cache slot, and its queries attend to the slot's first pos + T rows.
    for (int64_t b = 0; b < B; ++b) {
      const int64_t pos = positions[static_cast<size_t>(b)];
      ANVIL_ASSERT(pos >= 0 && pos + T <= capacity, "position ", pos, " + ", T, " beyond the cache's ", capacity);
      Tensor qb = q.slice(b, 1), kb = k.slice(b, 1), vb = v.slice(b, 1), ob = o.slice(b, 1);
      rope_forward(qb, rope_, pos, qb);
      rope_forward(kb, rope_, pos, kb);
      Tensor slot_k = cache_k.slice(slots[static_cast<size_t>(b)], 1).view({capacity, Hkv, hd});
      Tensor slot_v = cache_v.slice(slots[static_cast<size_t>(b)], 1).view({capacity, Hkv, hd});
      slot_k.slice(pos, T).view({1, T, Hkv, hd}).copy_from(kb);
      slot_v.slice(pos, T).view({1, T, Hkv, hd}).copy_from(vb);
      attention_forward(qb, slot_k.slice(0, pos + T).view({1, pos + T, Hkv, hd}),
                        slot_v.slice(0, pos + T).view({1, pos + T, Hkv, hd}), ob, lse, 0.0f, {}, {pos, 0});
    }
    s.x2 = style_.row_parallel_out(x, o.view({M, Hq * hd}), p.wo, "block.x2");
  }
  return run_feed_forward(s, /*recomputing=*/false);
}

Tensor TransformerBlock::run_forward(BlockSaved& s, bool recomputing) const {
  const BlockParams p = compute_params();
  const DType dt = params_.compute_dtype();
  // Hq, Hkv: the heads this block's parameters hold.
  const int64_t B = s.B, T = s.T, M = B * T, Ml = style_.residual_rows(M), D = dim_, hd = head_dim_, Hq = heads_,
                Hkv = kv_heads_;

  const SpanCategory cat = recomputing ? SpanCategory::recompute : SpanCategory::forward;
  // Attention: h1 = norm(x); q, k, v = h1·W{q,k,v}ᵀ; RoPE; o = attention; x2 = x + o·Woᵀ
  std::optional<ScopedPhase> phase;
  phase.emplace(cat, recomputing ? "attention.recompute" : "attention.forward", layer_);
  s.h1 = new_activation({Ml, D}, dt, "block.h1");
  s.rstd1 = new_activation({Ml}, DType::f32, "block.rstd1");
  rmsnorm_forward(s.x, p.attention_norm, eps_, s.h1, s.rstd1);
  s.h1 = style_.gather_rows(s.h1, "block.h1");
  s.q = new_activation({B, T, Hq, hd}, dt, "block.q");
  s.k = new_activation({B, T, Hkv, hd}, dt, "block.k");
  s.v = new_activation({B, T, Hkv, hd}, dt, "block.v");
  Tensor v2 = s.v.view({M, Hkv * hd});
  project_heads(s.h1, p.wq, p.q_norm, s.q, s.q_raw, s.rstd_q, /*keys=*/false);
  project_heads(s.h1, p.wk, p.k_norm, s.k, s.k_raw, s.rstd_k, /*keys=*/true);
  linear_forward(s.h1, p.wv, v2);
  style_.rope_forward(s.q, rope_, s.q);
  style_.rope_forward(s.k, rope_, s.k);
  s.o = new_activation({B, T, Hq, hd}, dt, "block.o");
  s.lse = new_activation({B, Hq, T}, DType::f32, "block.lse");
  style_.attention_forward(s.q, s.k, s.v, s.o, s.lse, s.documents);
  s.x2 = style_.row_parallel_out(s.x, s.o.view({M, Hq * hd}), p.wo, "block.x2");
  phase.reset();
  return run_feed_forward(s, recomputing);
}

// Feed-forward: h2 = norm(x2); out = x2 + (silu(h2·W1ᵀ) ⊙ h2·W3ᵀ)·W2ᵀ
Tensor TransformerBlock::run_feed_forward(BlockSaved& s, bool recomputing) const {
  const BlockParams p = compute_params();
  const DType dt = params_.compute_dtype();
  const int64_t M = s.B * s.T, Ml = style_.residual_rows(M), D = dim_;
  const ScopedPhase phase(recomputing ? SpanCategory::recompute : SpanCategory::forward,
                          recomputing ? "feed_forward.recompute" : "feed_forward.forward", layer_);
  s.h2 = new_activation({Ml, D}, dt, "block.h2");
  s.rstd2 = new_activation({Ml}, DType::f32, "block.rstd2");
  rmsnorm_forward(s.x2, p.ffn_norm, eps_, s.h2, s.rstd2);
  s.h2 = style_.gather_rows(s.h2, "block.h2");
  return feed_forward(s, p);
}

Tensor TransformerBlock::feed_forward(BlockSaved& s, const BlockParams& p) const {
  const DType dt = params_.compute_dtype();
  const int64_t M = s.B * s.T, F = ffn_;
  if (router_.top_k > 0) {  // out = x2 + moe(h2), h2 every row of the micro-batch
    const ExpertWidthSplit* split = style_.expert_width_split();
    const SequenceLayout* layout = style_.sequence_layout();
    if (!split) return moe_forward(s.h2, p.moe, router_, s.moe, s.B, s.x2, exchange_, layout);
    // Each rank's experts are slices of their width: a partial output, reduced as a row-parallel product's.
    const Tensor partial = moe_forward(s.h2, p.moe, router_, s.moe, s.B, {}, exchange_, layout);
    return style_.reduce_partial_out(s.x2, partial, "block.out");
  }
  s.g = new_activation({M, F}, dt, "block.g");
  s.u = new_activation({M, F}, dt, "block.u");
  linear_forward(s.h2, p.w1, s.g);
  linear_forward(s.h2, p.w3, s.u);
  s.s = new_activation({M, F}, dt, "block.s");
  swiglu_forward(s.g, s.u, s.s);
  return style_.row_parallel_out(s.x2, s.s, p.w2, "block.out");
}

void TransformerBlock::report_routing(const BlockSaved& s) const {
  if (router_.top_k == 0) return;
  MoeStepState& st = *moe_state_;
  const int64_t E = st.num_experts;
  int64_t* routes = st.routes.data() + layer_ * E;
  for (int64_t e = 0; e < E; ++e) routes[e] += s.moe.routes.rows(e);
  st.aux_sum += s.moe.aux_loss;
  st.aux_terms += s.moe.sequences;
  const int64_t routed = s.moe.experts.size(0) * s.moe.experts.size(1), received = s.moe.xe.size(0);
  st.received_rows = std::max(st.received_rows, received);
  if (routed > 0)
    st.received_share = std::max(st.received_share, static_cast<double>(received) / static_cast<double>(routed));
  if (st.record_experts) {
    Tensor copy = Tensor::empty(s.moe.experts.shape(), DType::i32, MemCategory::workspace, "moe.recorded_experts");
    copy.copy_from(s.moe.experts);
    st.experts.push_back(copy);
  }
}

void TransformerBlock::drop_unkept(BlockSaved& s, const AcPolicy& policy) const {
  if (policy.recomputes_whole_block(layer_)) {
    BlockSaved kept;
    kept.B = s.B, kept.T = s.T;
    kept.documents = s.documents;
    kept.x = s.x;
    s = kept;
  } else if (policy.mode == AcMode::selective_op) {
    // Keep matmul and attention outputs; the norms and SwiGLU are cheap to redo.
    s.h1 = s.rstd1 = s.h2 = s.rstd2 = s.s = s.moe.s = Tensor();
  }
}

void TransformerBlock::recompute(BlockSaved& s) const {
  const bool moe = router_.top_k > 0;
  if (s.q.defined() && s.h1.defined() && s.h2.defined() && (moe ? s.moe.s : s.s).defined()) return;  // all kept
  const ScopedPhase phase(SpanCategory::recompute, "recompute", layer_);
  if (!s.q.defined()) {  // only the input was kept: run the whole block again
    run_forward(s, /*recomputing=*/true);
    return;
  }
  const BlockParams p = compute_params();
  const DType dt = params_.compute_dtype();
  const int64_t M = s.B * s.T, Ml = style_.residual_rows(M), D = dim_, F = ffn_;
  if (!s.h1.defined()) {
    s.h1 = new_activation({Ml, D}, dt, "block.h1");
    s.rstd1 = new_activation({Ml}, DType::f32, "block.rstd1");
    rmsnorm_forward(s.x, p.attention_norm, eps_, s.h1, s.rstd1);
    s.h1 = style_.gather_rows(s.h1, "block.h1");
  }
  if (!s.h2.defined()) {
    s.h2 = new_activation({Ml, D}, dt, "block.h2");
    s.rstd2 = new_activation({Ml}, DType::f32, "block.rstd2");
    rmsnorm_forward(s.x2, p.ffn_norm, eps_, s.h2, s.rstd2);
    s.h2 = style_.gather_rows(s.h2, "block.h2");
  }
  if (moe && !s.moe.s.defined()) {
    s.moe.s = new_activation(s.moe.g.shape(), dt, "moe.s");
    swiglu_forward(s.moe.g, s.moe.u, s.moe.s);
  } else if (!moe && !s.s.defined()) {
    s.s = new_activation({M, F}, dt, "block.s");
    swiglu_forward(s.g, s.u, s.s);
  }
}

Tensor TransformerBlock::backward(BlockSaved& saved, Tensor dout) { return run_backward(saved, std::move(dout), nullptr); }

Tensor TransformerBlock::backward_input(BlockSaved& saved, Tensor dout, WeightGradWork& work) {
  return run_backward(saved, std::move(dout), &work);
}

void TransformerBlock::backward_weight(WeightGradWork& work) {
  const ScopedPhase phase(SpanCategory::backward, "weight_grad", layer_);
  for (WeightGradWork::Product& p : work.products) linear_backward_weight(p.dy, p.x, p.grad);
  work.products.clear();  // frees what only they held
}

Tensor TransformerBlock::feed_forward_backward(BlockSaved& s, const BlockParams& p, BlockParams& gp, const Tensor& dout,
                                               const WeightGrad& weight_grad) const {
  const DType dt = params_.compute_dtype();
  const int64_t M = s.B * s.T, F = ffn_;
  if (router_.top_k > 0) {
    // The MoE layer makes its weight gradients at once, in either pass (its
    // grouped products are not split into the weight-gradient pass).
    ANVIL_ASSERT(moe_state_->aux_grad_coef >= 0, "a mixture-of-experts model trains after set_step_sequences");
    const ExpertWidthSplit* split = style_.expert_width_split();
    Tensor dout_full = split ? style_.gather_rows(dout, "block.dout") : dout;  // (M, D)
    Tensor dh2 = new_activation({M, dim_}, dt, split ? "block.dh2_partial" : "block.dh2");
    moe_backward(dout_full, s.h2, p.moe, router_, moe_state_->aux_grad_coef, s.moe, dh2, gp.moe, exchange_, split);
    dout_full = Tensor();
    s.h2 = Tensor();
    return split ? style_.reduce_partial_grad(dh2, dt, "block.dh2") : dh2;
  }
  Tensor dout_full = style_.gather_rows(dout, "block.dout");  // (M, D)
  Tensor ds = new_activation({M, F}, dt, "block.ds");
  linear_backward_input(dout_full, p.w2, ds);
  weight_grad(dout_full, s.s, gp.w2);
  dout_full = Tensor();
  s.s = Tensor();
  // dg and du overwrite g and u: they are not needed after this.
  swiglu_backward(ds, s.g, s.u, s.g, s.u);
  ds = Tensor();
  Tensor dh2 = style_.column_input_grad({{s.g, p.w1}, {s.u, p.w3}}, dt, "block.dh2");  // (M_l, D)
  weight_grad(s.g, s.h2, gp.w1);
  weight_grad(s.u, s.h2, gp.w3);
  s.g = s.u = s.h2 = Tensor();
  return dh2;
}

Tensor TransformerBlock::run_backward(BlockSaved& s, Tensor dout, WeightGradWork* work) {
  recompute(s);
  const BlockParams p = compute_params();
  BlockParams gp = grad_params();
  const DType dt = params_.compute_dtype();
  const int64_t B = s.B, T = s.T, M = B * T, hd = head_dim_, Hq = heads_, Hkv = kv_heads_;
  // dout (M_l, D): gradient of the block output; it becomes dx2, then dx, in place.

  // grad += dyᵀ·x now, or in the weight-gradient pass. The output gradient
  // `dy` may be dout's own buffer, which the norm backwards below add into:
  // a deferred product then keeps a copy of it as it is now.
  auto weight_grad = [&](const Tensor& dy, const Tensor& x, Tensor& grad) {
    if (work == nullptr) return linear_backward_weight(dy, x, grad);
    Tensor kept = dy;
    if (dy.raw() == dout.raw()) {
      kept = new_activation(dy.shape(), dy.dtype(), "block.dout_for_weight_grad");
      kept.copy_from(dy);
    }
    work->products.push_back({kept, x, grad});
  };
  // Where the two norms' weight gradients accumulate: the ffn norm's, the attention norm's.
  const NormGradTargets norm_grads = style_.norm_grad_targets({gp.ffn_norm, gp.attention_norm});
  Tensor g_ffn_norm = norm_grads.at[0], g_attention_norm = norm_grads.at[1];

  // Feed-forward, in reverse.
  {
    const ScopedPhase phase(SpanCategory::backward, "feed_forward.backward", layer_);
    Tensor dh2 = feed_forward_backward(s, p, gp, dout, weight_grad);  // (M_l, D)
    rmsnorm_backward(dh2, s.x2, p.ffn_norm, s.rstd2, eps_, dout, g_ffn_norm, /*accumulate_dx=*/true);
    s.x2 = s.rstd2 = Tensor();
  }
  // Attention, in reverse.
  {
    const ScopedPhase phase(SpanCategory::backward, "attention.backward", layer_);
    Tensor dout_full = style_.gather_rows(dout, "block.dout");  // (M, D)
    Tensor dO = new_activation({B, T, Hq, hd}, dt, "block.do");
    Tensor dO2 = dO.view({M, Hq * hd});
    linear_backward_input(dout_full, p.wo, dO2);
    weight_grad(dout_full, s.o.view({M, Hq * hd}), gp.wo);
    dout_full = Tensor();
    Tensor dq = new_activation({B, T, Hq, hd}, dt, "block.dq");
    Tensor dk = new_activation({B, T, Hkv, hd}, dt, "block.dk");
    Tensor dv = new_activation({B, T, Hkv, hd}, dt, "block.dv");
    style_.attention_backward(dO, s.q, s.k, s.v, s.o, s.lse, dq, dk, dv, s.documents);
    dO = dO2 = Tensor();
    s.q = s.k = s.v = s.o = s.lse = Tensor();
    style_.rope_backward(dq, rope_, dq);
    style_.rope_backward(dk, rope_, dk);
    if (qk_norm_) {  // through the q/k norms, to the projections' gradients
      const NormGradTargets head_norm_grads =
          style_.norm_grad_targets({gp.q_norm, gp.k_norm}, ParallelStyle::NormRows::heads);
      const auto through_norm = [&](Tensor& d, Tensor& raw, Tensor& rstd, const Tensor& w, Tensor& dw,
                                    const char* tag) {
        const int64_t rows = d.numel() / hd;
        Tensor d_raw = new_activation(d.shape(), dt, tag);
        Tensor d_raw_rows = d_raw.view({rows, hd});
        rmsnorm_backward(d.view({rows, hd}), raw.view({rows, hd}), w, rstd, eps_, d_raw_rows, dw);
        d = d_raw;
        raw = rstd = Tensor();
      };
      Tensor g_q_norm = head_norm_grads.at[0], g_k_norm = head_norm_grads.at[1];
      through_norm(dq, s.q_raw, s.rstd_q, p.q_norm, g_q_norm, "block.dq_raw");
      through_norm(dk, s.k_raw, s.rstd_k, p.k_norm, g_k_norm, "block.dk_raw");
      style_.finish_norm_grads(head_norm_grads, {gp.q_norm, gp.k_norm});
    }
    const Tensor dq2 = dq.view({M, Hq * hd}), dk2 = dk.view({M, Hkv * hd}), dv2 = dv.view({M, Hkv * hd});
    Tensor dh1 = style_.column_input_grad({{dq2, p.wq}, {dk2, p.wk}, {dv2, p.wv}}, dt, "block.dh1");  // (M_l, D)
    weight_grad(dq2, s.h1, gp.wq);
    weight_grad(dk2, s.h1, gp.wk);
    weight_grad(dv2, s.h1, gp.wv);
    s.h1 = Tensor();
    rmsnorm_backward(dh1, s.x, p.attention_norm, s.rstd1, eps_, dout, g_attention_norm, /*accumulate_dx=*/true);
  }
  style_.finish_norm_grads(norm_grads, {gp.ffn_norm, gp.attention_norm});
  s = BlockSaved{};
  return dout;
}

}  // namespace anvil
