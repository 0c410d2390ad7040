#include "anvil/model/llama.h"

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

std::vector<ParamSpec> llama_param_specs(const ModelArgs& a) {
  const int64_t D = a.dim, hd = a.head_dim(), F = a.ffn_hidden_dim();
  std::vector<ParamSpec> specs;
  // Groups: 0 the embedding, 1 + l block l, n_layers + 1 the head.
  specs.push_back({"model.embed_tokens.weight", {a.vocab_size, D}, ParamInit::normal, 1.0f, 0});
  for (int64_t l = 0; l < a.n_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    // torchtitan's depth-scaled init for the projections that write into the residual stream.
    const float depth_std = 0.02f / std::sqrt(2.0f * static_cast<float>(l + 1));
    const int g = static_cast<int>(l) + 1;
    specs.push_back({p + "input_layernorm.weight", {D}, ParamInit::ones, 0.02f, g});
    specs.push_back({p + "self_attn.q_proj.weight", {a.n_heads * hd, D}, ParamInit::trunc_normal, 0.02f, g});
    specs.push_back({p + "self_attn.k_proj.weight", {a.n_kv_heads * hd, D}, ParamInit::trunc_normal, 0.02f, g});
    specs.push_back({p + "self_attn.v_proj.weight", {a.n_kv_heads * hd, D}, ParamInit::trunc_normal, 0.02f, g});
    specs.push_back({p + "self_attn.o_proj.weight", {D, a.n_heads * hd}, ParamInit::trunc_normal, depth_std, g});
    specs.push_back({p + "post_attention_layernorm.weight", {D}, ParamInit::ones, 0.02f, g});
    specs.push_back({p + "mlp.gate_proj.weight", {F, D}, ParamInit::trunc_normal, 0.02f, g});
    specs.push_back({p + "mlp.up_proj.weight", {F, D}, ParamInit::trunc_normal, depth_std, g});
    specs.push_back({p + "mlp.down_proj.weight", {D, F}, ParamInit::trunc_normal, depth_std, g});
  }
  const int head = static_cast<int>(a.n_layers) + 1;
  specs.push_back({"model.norm.weight", {D}, ParamInit::ones, 0.02f, head});
  if (!a.tie_embeddings)
    specs.push_back({"lm_head.weight", {a.vocab_size, D}, ParamInit::trunc_normal,
                     1.0f / std::sqrt(static_cast<float>(D)), head});
  return specs;
}

Llama::Llama(const ModelArgs& args, DType compute_dtype, int64_t max_seq_len, bool allocate_params)
    : args_(args), params_(llama_param_specs(args), compute_dtype, allocate_params) {
  args_.validate();
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

Tensor Llama::embed(const Tensor& tokens) const {
  Tensor h = activation({tokens.numel(), args_.dim}, compute_dtype(), "embed.out");
  embedding_forward(tokens, params_.compute(embed_index_), h);
  return h;
}

Tensor Llama::block_forward(int layer, BlockSaved& s, int64_t B, int64_t T, bool recomputing) const {
  const BlockParams p = block_compute(layer);
  const DType dt = compute_dtype();
  const int64_t M = B * T, D = args_.dim, hd = args_.head_dim(), Hq = args_.n_heads, Hkv = args_.n_kv_heads;
  const int64_t F = args_.ffn_hidden_dim();
  const float eps = static_cast<float>(args_.norm_eps);

  const SpanCategory cat = recomputing ? SpanCategory::recompute : SpanCategory::forward;
  // Attention: h1 = norm(x); q, k, v = h1·W{q,k,v}ᵀ; RoPE; o = attention; x2 = x + o·Woᵀ
  std::optional<ScopedPhase> phase;
  phase.emplace(cat, recomputing ? "attention.recompute" : "attention.forward", layer);
  s.h1 = activation({M, D}, dt, "block.h1");
  s.rstd1 = activation({M}, DType::f32, "block.rstd1");
  rmsnorm_forward(s.x, p.attention_norm, eps, s.h1, s.rstd1);
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
  s.x2 = activation({M, D}, dt, "block.x2");
  s.x2.copy_from(s.x);
  linear_accumulate(s.o.view({M, Hq * hd}), p.wo, s.x2);

  // Feed-forward: h2 = norm(x2); out = x2 + (silu(h2·W1ᵀ) ⊙ h2·W3ᵀ)·W2ᵀ
  phase.reset();
  phase.emplace(cat, recomputing ? "feed_forward.recompute" : "feed_forward.forward", layer);
  s.h2 = activation({M, D}, dt, "block.h2");
  s.rstd2 = activation({M}, DType::f32, "block.rstd2");
  rmsnorm_forward(s.x2, p.ffn_norm, eps, s.h2, s.rstd2);
  s.g = activation({M, F}, dt, "block.g");
  s.u = activation({M, F}, dt, "block.u");
  linear_forward(s.h2, p.w1, s.g);
  linear_forward(s.h2, p.w3, s.u);
  s.s = activation({M, F}, dt, "block.s");
  swiglu_forward(s.g, s.u, s.s);
  Tensor out = activation({M, D}, dt, "block.out");
  out.copy_from(s.x2);
  linear_accumulate(s.s, p.w2, out);
  return out;
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
  const int64_t M = B * T, D = args_.dim, F = args_.ffn_hidden_dim();
  const float eps = static_cast<float>(args_.norm_eps);
  if (!s.h1.defined()) {
    s.h1 = activation({M, D}, dt, "block.h1");
    s.rstd1 = activation({M}, DType::f32, "block.rstd1");
    rmsnorm_forward(s.x, p.attention_norm, eps, s.h1, s.rstd1);
  }
  if (!s.h2.defined()) {
    s.h2 = activation({M, D}, dt, "block.h2");
    s.rstd2 = activation({M}, DType::f32, "block.rstd2");
    rmsnorm_forward(s.x2, p.ffn_norm, eps, s.h2, s.rstd2);
  }
  if (!s.s.defined()) {
    s.s = activation({M, F}, dt, "block.s");
    swiglu_forward(s.g, s.u, s.s);
  }
}

Tensor Llama::block_backward(int layer, BlockSaved& s, Tensor dout, int64_t B, int64_t T) {
  recompute(layer, s, B, T);
  const BlockParams p = block_compute(layer);
  BlockParams gp = block_grads(layer);
  const DType dt = compute_dtype();
  const int64_t M = B * T, D = args_.dim, hd = args_.head_dim(), Hq = args_.n_heads, Hkv = args_.n_kv_heads;
  const int64_t F = args_.ffn_hidden_dim();
  const float eps = static_cast<float>(args_.norm_eps);
  // dout (M, D): gradient of the block output; it becomes dx2, then dx, in place.

  // Feed-forward, in reverse.
  {
    const ScopedPhase phase(SpanCategory::backward, "feed_forward.backward", layer);
    Tensor ds = activation({M, F}, dt, "block.ds");
    linear_backward_input(dout, p.w2, ds);
    linear_backward_weight(dout, s.s, gp.w2);
    s.s = Tensor();
    // dg and du overwrite g and u: they are not needed after this.
    swiglu_backward(ds, s.g, s.u, s.g, s.u);
    ds = Tensor();
    Tensor dh2 = activation({M, D}, dt, "block.dh2");
    linear_backward_input(s.g, p.w1, dh2);
    linear_backward_input(s.u, p.w3, dh2, /*accumulate_dx=*/true);
    linear_backward_weight(s.g, s.h2, gp.w1);
    linear_backward_weight(s.u, s.h2, gp.w3);
    s.g = s.u = s.h2 = Tensor();
    rmsnorm_backward(dh2, s.x2, p.ffn_norm, s.rstd2, eps, dout, gp.ffn_norm, /*accumulate_dx=*/true);
    s.x2 = s.rstd2 = Tensor();
  }
  // Attention, in reverse.
  {
    const ScopedPhase phase(SpanCategory::backward, "attention.backward", layer);
    Tensor dO = activation({B, T, Hq, hd}, dt, "block.do");
    Tensor dO2 = dO.view({M, Hq * hd});
    linear_backward_input(dout, p.wo, dO2);
    linear_backward_weight(dout, s.o.view({M, Hq * hd}), gp.wo);
    Tensor dq = activation({B, T, Hq, hd}, dt, "block.dq");
    Tensor dk = activation({B, T, Hkv, hd}, dt, "block.dk");
    Tensor dv = activation({B, T, Hkv, hd}, dt, "block.dv");
    attention_backward(dO, s.q, s.k, s.v, s.o, s.lse, dq, dk, dv);
    dO = dO2 = Tensor();
    s.q = s.k = s.v = s.o = s.lse = Tensor();
    rope_backward(dq, rope_, 0, dq);
    rope_backward(dk, rope_, 0, dk);
    const Tensor dq2 = dq.view({M, Hq * hd}), dk2 = dk.view({M, Hkv * hd}), dv2 = dv.view({M, Hkv * hd});
    Tensor dh1 = activation({M, D}, dt, "block.dh1");
    linear_backward_input(dq2, p.wq, dh1);
    linear_backward_input(dk2, p.wk, dh1, true);
    linear_backward_input(dv2, p.wv, dh1, true);
    linear_backward_weight(dq2, s.h1, gp.wq);
    linear_backward_weight(dk2, s.h1, gp.wk);
    linear_backward_weight(dv2, s.h1, gp.wv);
    s.h1 = Tensor();
    rmsnorm_backward(dh1, s.x, p.attention_norm, s.rstd1, eps, dout, gp.attention_norm, /*accumulate_dx=*/true);
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
              rope_.max_positions(), "; lower training.seq_len");
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
    dh = activation({M, D}, dt, "grad.residual");
    Tensor hn = activation({M, D}, dt, "final_norm.out");
    Tensor rstd = activation({M}, DType::f32, "final_norm.rstd");
    rmsnorm_forward(h, params_.compute(norm_index_), eps, hn, rstd);
    Tensor dhn = activation({M, D}, dt, "final_norm.dout");
    Tensor dw_out = params_.grad(output_index_);
    loss = cross_entropy_forward_backward(hn, params_.compute(output_index_), targets.view({M}), grad_scale, dhn,
                                          dw_out);
    hn = Tensor();
    Tensor gnorm = params_.grad(norm_index_);
    rmsnorm_backward(dhn, h, params_.compute(norm_index_), rstd, eps, dh, gnorm);
    dw_out = gnorm = Tensor();  // the hook may free the group's buffers
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
  embedding_backward(dh, tokens, g_embed);
  g_embed = Tensor();
  hooks_->after_backward(0);
  return loss;
}

CrossEntropyResult Llama::forward(const Tensor& tokens, const Tensor& targets) {
  const int64_t B = tokens.size(0), T = tokens.size(1), M = B * T, D = args_.dim;
  ANVIL_CHECK(T <= rope_.max_positions(), "sequence length ", T, " exceeds the model's maximum ",
              rope_.max_positions());
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
  Tensor hn = activation({M, D}, compute_dtype(), "final_norm.out");
  rmsnorm_forward(h, params_.compute(norm_index_), static_cast<float>(args_.norm_eps), hn);
  const CrossEntropyResult r = cross_entropy_forward(hn, params_.compute(output_index_), targets.view({M}));
  hooks_->after_forward(head);
  return r;
}

}  // namespace anvil
