#include "anvil/model/llama.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "anvil/core/error.h"
#include "anvil/core/profiler.h"

namespace anvil {

std::vector<ParamSpec> llama_param_specs(const ModelArgs& a) {
  const int64_t D = a.dim, Dq = a.n_heads * a.head_dim(), Dkv = a.n_kv_heads * a.head_dim(), F = a.ffn_hidden_dim();
  std::vector<ParamSpec> specs;
  auto add = [&](std::string name, Shape shape, ParamInit init, float std, int group) {
    ParamSpec s{std::move(name), std::move(shape), init, std, group};
    s.module = group == 0 ? ModuleKind::embedding : group <= a.n_layers ? ModuleKind::block : ModuleKind::head;
    s.layer = s.module == ModuleKind::block ? group - 1 : -1;
    specs.push_back(std::move(s));
  };
  add("model.embed_tokens.weight", {a.vocab_size, D}, ParamInit::normal, 1.0f, 0);
  for (int64_t l = 0; l < a.n_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    // torchtitan's depth-scaled init for the projections that write into the residual stream.
    const float depth_std = 0.02f / std::sqrt(2.0f * static_cast<float>(l + 1));
    const int g = static_cast<int>(l) + 1;
    add(p + "input_layernorm.weight", {D}, ParamInit::ones, 0.02f, g);
    add(p + "self_attn.q_proj.weight", {Dq, D}, ParamInit::trunc_normal, 0.02f, g);
    add(p + "self_attn.k_proj.weight", {Dkv, D}, ParamInit::trunc_normal, 0.02f, g);
    add(p + "self_attn.v_proj.weight", {Dkv, D}, ParamInit::trunc_normal, 0.02f, g);
    add(p + "self_attn.o_proj.weight", {D, Dq}, ParamInit::trunc_normal, depth_std, g);
    add(p + "post_attention_layernorm.weight", {D}, ParamInit::ones, 0.02f, g);
    if (a.moe()) {
      // Qwen3-MoE's names: the router, then every expert's gate, every up and
      // every down projection, so each projection's experts are one (E, ·, ·)
      // run of the store, the grouped products' operand.
      const int64_t Fm = a.moe_ffn_hidden;
      add(p + "mlp.gate.weight", {a.num_experts, D}, ParamInit::trunc_normal, 0.02f, g);
      for (const char* proj : {"gate_proj", "up_proj", "down_proj"})
        for (int64_t e = 0; e < a.num_experts; ++e)
          add(p + "mlp.experts." + std::to_string(e) + "." + proj + ".weight",
              proj[0] == 'd' ? Shape{D, Fm} : Shape{Fm, D}, ParamInit::trunc_normal,
              proj[0] == 'g' ? 0.02f : depth_std, g);
    } else {
      add(p + "mlp.gate_proj.weight", {F, D}, ParamInit::trunc_normal, 0.02f, g);
      add(p + "mlp.up_proj.weight", {F, D}, ParamInit::trunc_normal, depth_std, g);
      add(p + "mlp.down_proj.weight", {D, F}, ParamInit::trunc_normal, depth_std, g);
    }
    if (a.qk_norm) {  // Qwen3's per-head norms, after the Llama block's nine (TransformerBlock's offsets)
      add(p + "self_attn.q_norm.weight", {a.head_dim()}, ParamInit::ones, 0.02f, g);
      add(p + "self_attn.k_norm.weight", {a.head_dim()}, ParamInit::ones, 0.02f, g);
    }
  }
  const int head = static_cast<int>(a.n_layers) + 1;
  add("model.norm.weight", {D}, ParamInit::ones, 0.02f, head);
  if (!a.tie_embeddings)
    add("lm_head.weight", {a.vocab_size, D}, ParamInit::trunc_normal, 1.0f / std::sqrt(static_cast<float>(D)), head);
  return specs;
}

namespace {
// The expert a parameter belongs to ("model.layers.L.mlp.experts.e.…"), or -1.
int64_t expert_of(const ParamSpec& s) {
  const size_t found = s.name.find(".mlp.experts.");
  if (found == std::string::npos) return -1;
  const size_t at = found + 13;
  return std::stoll(s.name.substr(at, s.name.find('.', at) - at));
}
}  // namespace

std::vector<ParamSpec> llama_param_specs(const ModelArgs& args, const std::vector<ModuleRange>& stages,
                                         const ExpertShard& experts) {
  const int n = llama_num_modules(args);
  ANVIL_CHECK(!stages.empty(), "a rank of ", args.name, "/", args.flavor, " must hold at least one stage");
  std::vector<int> group_of(static_cast<size_t>(n), -1);  // whole-model module → this rank's group
  int held = 0, previous_end = 0;
  for (const ModuleRange& r : stages) {
    ANVIL_CHECK(previous_end <= r.first && r.first < r.end && r.end <= n, "a stage of ", args.name, "/",
                args.flavor, " holds modules [", r.first, ", ", r.end, ") of its ", n, " (embedding, ",
                args.n_layers, " blocks, head): it must be a non-empty range within them, after the rank's "
                "previous stage");
    for (int m = r.first; m < r.end; ++m) group_of[static_cast<size_t>(m)] = held++;
    previous_end = r.end;
  }
  ANVIL_CHECK(!args.tie_embeddings || (stages.size() == 1 && (stages[0].first == 0) == (stages[0].end == n)),
              args.name, "/", args.flavor, " ties the output head to the embedding, so one stage must hold both");
  ANVIL_CHECK(experts.size == 1 || (args.moe() && args.num_experts % experts.size == 0), args.name, "/",
              args.flavor, " cannot split its ", args.num_experts, " experts over ", experts.size,
              " expert-parallel ranks", args.moe() ? "" : " (it has none)");
  const int64_t per_rank = args.moe() ? args.num_experts / experts.size : 0;
  std::vector<ParamSpec> specs;
  for (ParamSpec& s : llama_param_specs(args)) {
    const int g = group_of[static_cast<size_t>(s.group)];
    if (g < 0) continue;
    const int64_t expert = expert_of(s);
    if (experts.size > 1 && expert >= 0) {
      if (expert / per_rank != experts.rank) continue;  // another rank's expert
      s.expert = true;
    }
    s.group = g;
    specs.push_back(std::move(s));
  }
  return specs;
}

namespace {
std::vector<ModuleRange> stages_or_whole(const ModelArgs& args, const LlamaOptions& options) {
  if (!options.stages.empty()) return options.stages;
  return {{0, llama_num_modules(args)}};
}
}  // namespace

Llama::Llama(const ModelArgs& args, DType compute_dtype, int64_t max_seq_len, const LlamaOptions& options)
    : args_(args),
      style_(options.parallel_style ? options.parallel_style : &single_process_),
      params_(style_->shard_params(llama_param_specs(args, stages_or_whole(args, options), options.expert_shard)),
              compute_dtype, options.allocate_params, options.compute_copy),
      expert_exchange_(options.expert_exchange) {
  ANVIL_ASSERT((options.expert_shard.size > 1) == (expert_exchange_ != nullptr) &&
                   (!expert_exchange_ || expert_exchange_->size() == options.expert_shard.size),
               "expert parallelism over ", options.expert_shard.size, " ranks needs their exchange");
  args_.validate();
  if (args_.moe()) {
    moe_state_.num_experts = args_.num_experts;
    moe_state_.routes.assign(static_cast<size_t>(args_.n_layers * args_.num_experts), 0);
    moe_state_.expert_bias.assign(static_cast<size_t>(args_.n_layers * args_.num_experts), 0.0f);
  }
  rope_ = rope_table(max_seq_len, args.head_dim(), args.rope_theta, args.rope_scaling);
  const int last = llama_num_modules(args) - 1;
  for (const ModuleRange& r : stages_or_whole(args, options)) {
    Stage st;
    st.modules = r;
    st.first_block = blocks_.size();
    for (int m = r.first; m < r.end; ++m) held_modules_.push_back(m);
    if (r.first == 0) {
      st.embedding = true;
      embedding_ = std::make_unique<TokenEmbedding>(params_, params_.index_of("model.embed_tokens.weight"), *style_);
    }
    for (int m = std::max(r.first, 1); m < std::min(r.end, last); ++m) {
      const int layer = m - 1;
      const int first_param = params_.index_of("model.layers." + std::to_string(layer) + ".input_layernorm.weight");
      blocks_.emplace_back(params_, first_param, layer, args_, rope_, *style_, args_.moe() ? &moe_state_ : nullptr,
                           expert_exchange_);
    }
    st.num_blocks = blocks_.size() - st.first_block;
    if (r.end == last + 1) {
      st.head = true;
      const int output = params_.index_of(args.tie_embeddings ? "model.embed_tokens.weight" : "lm_head.weight");
      head_ = std::make_unique<OutputHead>(params_, params_.index_of("model.norm.weight"), output, args_, *style_);
    }
    stages_.push_back(st);
  }
  if (compute_dtype == DType::bf16 && options.compute_copy == ComputeCopy::per_group) {
    // A tied head reads the embedding's weight, which is then in this stage (checked above).
    cast_ = std::make_unique<CastOnUse>(params_, options.cast_reshard, args.tie_embeddings ? group_of_module(0) : -1);
    hooks_ = cast_.get();
  }
}

void Llama::set_hooks(ParamGroupHooks* hooks) {
  if (cast_)
    cast_->set_inner(hooks);
  else
    hooks_ = hooks ? hooks : &no_hooks_;
}

void Llama::set_step_sequences(int64_t sequences) {
  ANVIL_ASSERT(sequences > 0, "a step of ", sequences, " sequences");
  moe_state_.aux_grad_coef =
      static_cast<float>(args_.router_aux_loss_coef / static_cast<double>(args_.n_layers * sequences));
}

void Llama::update_expert_bias(const std::vector<double>& routes) {
  const int64_t L = args_.n_layers, E = args_.num_experts;
  if (!args_.moe() || args_.moe_bias_update_rate <= 0) return;
  ANVIL_ASSERT(static_cast<int64_t>(routes.size()) == L * E, routes.size(), " routes for ", L, " x ", E);
  // DeepSeek-V3's rule, as torchtitan applies it: each expert's bias moves by
  // the rate towards the mean load (down when it took more routes, up when
  // fewer), less the moves' mean, so the biases keep a zero mean. In double,
  // the experts summed in order, so every rank moves them alike.
  std::vector<double> delta(static_cast<size_t>(E));
  for (int64_t l = 0; l < L; ++l) {
    const double* n = routes.data() + l * E;
    double mean = 0, mean_delta = 0;
    for (int64_t e = 0; e < E; ++e) mean += n[e];
    mean /= static_cast<double>(E);
    for (int64_t e = 0; e < E; ++e) {
      const double sign = n[e] < mean ? 1.0 : n[e] > mean ? -1.0 : 0.0;
      mean_delta += (delta[static_cast<size_t>(e)] = args_.moe_bias_update_rate * sign);
    }
    mean_delta /= static_cast<double>(E);
    float* b = moe_state_.expert_bias.data() + l * E;
    for (int64_t e = 0; e < E; ++e)
      b[e] = static_cast<float>(static_cast<double>(b[e]) + (delta[static_cast<size_t>(e)] - mean_delta));
  }
}

int Llama::group_of_module(int module) const {
  const auto it = std::lower_bound(held_modules_.begin(), held_modules_.end(), module);
  ANVIL_ASSERT(it != held_modules_.end() && *it == module, "module ", module, " is not on this rank");
  return static_cast<int>(it - held_modules_.begin());
}

const Llama::Stage& Llama::stage_at(int stage) const {
  ANVIL_ASSERT(stage >= 0 && stage < num_stages(), "stage ", stage, " of the ", num_stages(), " this rank holds");
  return stages_[static_cast<size_t>(stage)];
}

Tensor Llama::forward(int stage, const Tensor& input, int64_t B, int64_t T, const AcPolicy& policy,
                      StageSaved& saved, const Tensor& documents) {
  ANVIL_CHECK(T <= rope_.max_positions(), "sequence length ", T, " exceeds the model's maximum ",
              rope_.max_positions());
  const Stage& st = stage_at(stage);
  saved = StageSaved{};
  saved.B = B, saved.T = T;
  saved.blocks.resize(st.num_blocks);
  Tensor h = input;
  if (st.embedding) {
    ANVIL_ASSERT(input.dtype() == DType::i32 && input.ndim() == 2 && input.size(0) == B && input.size(1) == T,
                 "tokens ", shape_str(input.shape()), " for a (", B, ", ", T, ") micro-batch");
    const ScopedPhase phase(SpanCategory::forward, "embedding.forward");
    const int g = group_of_module(0);
    hooks_->before_forward(g);
    saved.tokens = input;
    h = embedding_->forward(input);
    hooks_->after_forward(g);
  }
  for (size_t i = 0; i < st.num_blocks; ++i) {
    const TransformerBlock& block = blocks_[st.first_block + i];
    const ScopedPhase phase(SpanCategory::forward, "forward", block.layer());
    const int g = group_of_module(block.layer() + 1);
    hooks_->before_forward(g);
    h = block.forward(h, B, T, policy, saved.blocks[i], documents);
    hooks_->after_forward(g);
  }
  if (st.head) saved.output = h;
  return h;
}

CrossEntropyResult Llama::backward_from_loss(int stage, StageSaved& saved, const Tensor& targets, float grad_scale,
                                             Tensor* d_input, BackwardPart part) {
  const Stage& st = stage_at(stage);
  ANVIL_ASSERT(st.head && saved.output.defined(), "the loss is the head's stage's, after its forward");
  ANVIL_ASSERT(targets.numel() == saved.B * saved.T, "targets ", shape_str(targets.shape()), " for a (", saved.B,
               ", ", saved.T, ") micro-batch");
  CrossEntropyResult loss;
  Tensor dh;
  {
    // The final norm, output projection and cross-entropy, forward and backward fused.
    const ScopedPhase phase(SpanCategory::loss, "loss");
    params_.ensure_grads();  // the backward starts here
    const int g = group_of_module(st.modules.end - 1);
    hooks_->before_forward(g);
    hooks_->before_backward(g);
    loss = head_->forward_backward(saved.output, targets.view({targets.numel()}), grad_scale, dh);
    hooks_->after_backward(g);
  }
  saved.output = Tensor();
  Tensor dx = backward_blocks(st, saved, std::move(dh), part);
  if (d_input) *d_input = dx;
  return loss;
}

CrossEntropyResult Llama::loss(StageSaved& saved, const Tensor& targets) {
  ANVIL_ASSERT(head_ && saved.output.defined(), "the loss is the head's stage's, after its forward");
  const int g = group_of_module(llama_num_modules(args_) - 1);
  hooks_->before_forward(g);
  const CrossEntropyResult r = head_->forward(saved.output, targets.view({targets.numel()}));
  hooks_->after_forward(g);
  saved = StageSaved{};
  return r;
}

Tensor Llama::forward_cached(const Tensor& tokens, const std::vector<int64_t>& slots,
                             const std::vector<int64_t>& positions, KvCache& cache) {
  ANVIL_ASSERT(stages_.size() == 1 && embedding_ && head_ && style_ == &single_process_,
               "a key/value cache runs the whole model on one process");
  ANVIL_ASSERT(
      tokens.dtype() == DType::i32 && tokens.ndim() == 2 && tokens.size(0) == static_cast<int64_t>(slots.size()),
      "tokens ", shape_str(tokens.shape()), " for ", slots.size(), " sequences");
  ANVIL_ASSERT(cache.k.size() == blocks_.size(), "a cache of ", cache.k.size(), " blocks for ", blocks_.size());
  const int64_t B = tokens.size(0), T = tokens.size(1);
  for (const int64_t p : positions)
    ANVIL_CHECK(p + T <= rope_.max_positions(), "position ", p + T, " exceeds the model's maximum ",
                rope_.max_positions());
  Tensor h = embedding_->forward(tokens);
  for (size_t i = 0; i < blocks_.size(); ++i)
    h = blocks_[i].forward_cached(h, T, slots, positions, cache.k[i], cache.v[i]);
  if (T > 1) {  // only each sequence's last row goes through the head
    Tensor last = new_activation({B, args_.dim}, h.dtype(), "generate.last");
    for (int64_t b = 0; b < B; ++b) last.slice(b, 1).copy_from(h.slice(b * T + T - 1, 1));
    h = last;
  }
  return head_->logits(h);
}

Tensor Llama::logits(const StageSaved& saved) {
  ANVIL_ASSERT(head_ && saved.output.defined(), "logits are the head's stage's, after its forward");
  const int g = group_of_module(llama_num_modules(args_) - 1);
  hooks_->before_forward(g);
  Tensor out = head_->logits(saved.output);
  hooks_->after_forward(g);
  return out;
}

Tensor Llama::backward(int stage, StageSaved& saved, Tensor d_output, BackwardPart part) {
  const Stage& st = stage_at(stage);
  ANVIL_ASSERT(!st.head, "the head's stage's backward starts from its loss (backward_from_loss)");
  params_.ensure_grads();
  return backward_blocks(st, saved, std::move(d_output), part);
}

// Under BackwardPart::input a module's hooks see before_backward here and
// after_backward only when its weight gradients are done (backward_weight):
// data parallelism must not reduce a gradient that is still being summed.
Tensor Llama::backward_blocks(const Stage& st, StageSaved& saved, Tensor dh, BackwardPart part) {
  const bool split = part == BackwardPart::input;
  if (split) saved.weight_work.resize(st.num_blocks);
  for (size_t i = st.num_blocks; i-- > 0;) {
    TransformerBlock& block = blocks_[st.first_block + i];
    const ScopedPhase phase(SpanCategory::backward, split ? "backward_input" : "backward", block.layer());
    const int g = group_of_module(block.layer() + 1);
    hooks_->before_backward(g);
    if (split) {
      dh = block.backward_input(saved.blocks[i], dh, saved.weight_work[i]);
    } else {
      dh = block.backward(saved.blocks[i], dh);
      hooks_->after_backward(g);
    }
  }
  saved.blocks.clear();
  if (!st.embedding) return dh;
  if (split) saved.d_embedding = dh;  // the embedding's gradient is all weight gradient
  else embedding_backward(saved, dh);
  return Tensor();
}

void Llama::embedding_backward(StageSaved& saved, const Tensor& dh) {
  const ScopedPhase phase(SpanCategory::backward, "embedding.backward");
  const int g = group_of_module(0);
  hooks_->before_backward(g);
  embedding_->backward(saved.tokens, dh);
  hooks_->after_backward(g);
  saved.tokens = Tensor();
}

void Llama::backward_weight(int stage, StageSaved& saved) {
  const Stage& st = stage_at(stage);
  ANVIL_ASSERT(saved.weight_work.size() == st.num_blocks, "backward_weight after a BackwardPart::input backward");
  for (size_t i = st.num_blocks; i-- > 0;) {
    TransformerBlock& block = blocks_[st.first_block + i];
    const ScopedPhase phase(SpanCategory::backward, "backward_weight", block.layer());
    block.backward_weight(saved.weight_work[i]);
    hooks_->after_backward(group_of_module(block.layer() + 1));
  }
  saved.weight_work.clear();
  if (st.embedding) embedding_backward(saved, saved.d_embedding);
  saved.d_embedding = Tensor();
}

CrossEntropyResult Llama::forward_backward(const Tensor& tokens, const Tensor& targets, float grad_scale,
                                           const AcPolicy& policy, const Tensor& documents) {
  ANVIL_ASSERT(tokens.ndim() == 2 && targets.shape() == tokens.shape(), "tokens ", shape_str(tokens.shape()),
               " targets ", shape_str(targets.shape()));
  ANVIL_ASSERT(num_stages() == 1 && embedding_ && head_,
               "forward_backward runs the whole model; a stage runs forward and backward");
  StageSaved saved;
  forward(tokens, tokens.size(0), tokens.size(1), policy, saved, documents);
  return backward_from_loss(saved, targets, grad_scale);
}

CrossEntropyResult Llama::forward(const Tensor& tokens, const Tensor& targets, const Tensor& documents) {
  ANVIL_ASSERT(num_stages() == 1 && embedding_ && head_, "evaluation runs the whole model");
  const int64_t B = tokens.size(0), T = tokens.size(1);
  ANVIL_CHECK(T <= rope_.max_positions(), "sequence length ", T, " exceeds the model's maximum ",
              rope_.max_positions());
  hooks_->before_forward(group_of_module(0));
  Tensor h = embedding_->forward(tokens);
  hooks_->after_forward(group_of_module(0));
  for (const TransformerBlock& block : blocks_) {
    const int g = group_of_module(block.layer() + 1);
    hooks_->before_forward(g);
    h = block.forward(h, B, T, documents);
    hooks_->after_forward(g);
  }
  const int g = group_of_module(llama_num_modules(args_) - 1);
  hooks_->before_forward(g);
  const CrossEntropyResult r = head_->forward(h, targets.view({targets.numel()}));
  hooks_->after_forward(g);
  return r;
}

}  // namespace anvil
