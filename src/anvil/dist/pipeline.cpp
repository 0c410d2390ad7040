#include "anvil/dist/pipeline.h"

#include <map>

#include "anvil/core/error.h"
#include "anvil/core/profiler.h"

namespace anvil {

std::pair<int, int> pipeline_stage_modules(const ModelArgs& args, const PipelineSplit& split, int stage) {
  const int n = static_cast<int>(args.n_layers), P = split.stages;
  const int in = split.first_stage_less_layers, out = split.last_stage_less_layers;
  ANVIL_CHECK(in >= 0 && out >= 0, "parallelism.pipeline_parallel_first_stage_less_layers and "
              "last_stage_less_layers must be 0 or more");
  const int units = n + in + out;  // the blocks, plus the embedding's and the head's worth
  ANVIL_CHECK(P >= 1 && P <= units, args.name, "/", args.flavor, " has ", n, " blocks (", units,
              " units counting the embedding as ", in, " and the head as ", out, ") to cut into ", P,
              " pipeline stages; use at most ", units, " stages");
  const int base = units / P, extra = units % P;
  auto first_unit = [&](int s) { return s * base + std::min(s, extra); };
  ANVIL_CHECK(in <= base + (extra > 0 ? 1 : 0) && out <= base, "pipeline stages of ", base, " or ", base + 1,
              " units cannot hold the embedding counted as ", in,
              " (parallelism.pipeline_parallel_first_stage_less_layers) and the head counted as ", out,
              " (last_stage_less_layers); lower them or use fewer stages");
  ANVIL_ASSERT(stage >= 0 && stage < P);
  // Unit u < in is the embedding's, in <= u < in + n block u − in, the rest the head's.
  const int first = stage == 0 ? 0 : 1 + first_unit(stage) - in;
  const int end = stage == P - 1 ? n + 2 : 1 + first_unit(stage + 1) - in;
  ANVIL_CHECK(first < end && (stage == 0 || first >= 1) && (stage == P - 1 || end <= n + 1), "pipeline stage ",
              stage, " of ", P, " would hold no block of ", args.name, "/", args.flavor,
              "; use fewer stages or change the first/last stage's counts");
  return {first, end};
}

std::string describe_pipeline_stages(const ModelArgs& args, const PipelineSplit& split) {
  const int n = static_cast<int>(args.n_layers);
  std::string out;
  for (int s = 0; s < split.stages; ++s) {
    const auto [first, end] = pipeline_stage_modules(args, split, s);
    std::vector<std::string> parts;
    if (first == 0) parts.push_back("embedding");
    const int b0 = std::max(first, 1) - 1, b1 = std::min(end, n + 1) - 1;  // blocks [b0, b1)
    if (b1 - b0 == 1) parts.push_back(detail::concat("block ", b0));
    if (b1 - b0 > 1) parts.push_back(detail::concat("blocks ", b0, "-", b1 - 1));
    if (end == n + 2) parts.push_back("head");
    out += detail::concat(s ? "; " : "", "stage ", s, ":");
    for (size_t i = 0; i < parts.size(); ++i) out += (i ? ", " : " ") + parts[i];
  }
  return out;
}

Tensor gather_pipeline_stages(Communicator& pp, const ModelArgs& args, const PipelineSplit& split,
                              const Tensor& stage_flat) {
  const int P = pp.size();
  auto stage_layout = [&](int s) {
    const auto [first, end] = pipeline_stage_modules(args, split, s);
    return ParamStore(llama_param_specs(args, first, end), DType::f32, /*allocate=*/false);
  };
  if (pp.rank() != 0) {
    pp.send(stage_flat, 0, /*tag=*/0);
    return Tensor();
  }
  const ParamStore whole(llama_param_specs(args), DType::f32, /*allocate=*/false);
  Tensor out = Tensor::zeros({whole.numel()}, DType::f32, MemCategory::workspace, "pp.global_state");
  for (int s = 0; s < P; ++s) {
    const ParamStore layout = stage_layout(s);
    Tensor part = stage_flat;
    if (s > 0) {
      part = Tensor::empty({layout.numel()}, DType::f32, MemCategory::communication, "pp.stage_state");
      pp.recv(part, s, /*tag=*/0);
    }
    for (const ParamSpec& spec : layout.specs()) {
      Tensor dst = out.slice(whole.specs()[static_cast<size_t>(whole.index_of(spec.name))].offset, spec.numel());
      dst.copy_from(part.slice(spec.offset, spec.numel()));
    }
  }
  return out;
}

PipelineStage::PipelineStage(Llama& model, Communicator& pp, bool keep_outputs)
    : model_(model), pp_(pp), stage_(pp.rank()), stages_(pp.size()), keep_outputs_(keep_outputs) {
  ANVIL_ASSERT(model.has_embedding() == first() && model.has_head() == last(),
               "pp rank ", stage_, " must hold stage ", stage_, " of ", stages_);
}

// Tags: a micro-batch's activation 2·i, its gradient 2·i + 1 (MPI keeps the
// order of messages with the same source and tag, so steps cannot mix).
Tensor PipelineStage::receive(int from_stage, int tag, int64_t B, int64_t T, const char* what) {
  const int64_t M = B * T;
  Tensor t = Tensor::empty({model_.residual_rows(M), model_.args().dim}, model_.compute_dtype(),
                           MemCategory::activations, what);
  const ScopedPhase phase(SpanCategory::communication, what);
  pp_.recv(t, from_stage, tag);
  return t;
}

void PipelineStage::send(const Tensor& t, int to_stage, int tag) {
  sends_.push_back({pp_.isend(t, to_stage, tag), t});
  complete_sends(/*wait=*/false);
}

void PipelineStage::complete_sends(bool wait) {
  std::vector<Send> still;
  for (Send& s : sends_) {
    if (wait) s.work.wait();
    else if (!s.work.test()) {
      still.push_back(std::move(s));
      continue;
    }
  }
  sends_ = std::move(still);  // completed sends release their buffers
}

CrossEntropyResult PipelineStage::evaluate(const Tensor& tokens, const Tensor& targets) {
  const int64_t B = tokens.size(0), T = tokens.size(1);
  StageSaved saved;  // full checkpointing: each block keeps its input only, until the stage is done
  const Tensor input = first() ? tokens : receive(stage_ - 1, 0, B, T, "pipeline.recv_activation");
  const Tensor out = model_.forward(input, B, T, AcPolicy{AcMode::full, 1}, saved);
  if (last()) return model_.loss(saved, targets);
  pp_.send(out, stage_ + 1, 0);
  return {};
}

PipelineResult PipelineStage::run(const std::vector<PipeAction>& actions, const std::vector<Tensor>& tokens,
                                  const std::vector<Tensor>& targets, float grad_scale, const AcPolicy& policy,
                                  const std::function<void(int)>& before_backward) {
  PipelineResult result;
  std::map<int, StageSaved> in_flight;  // micro-batch → its saved state, from its forward to its backward
  std::vector<Tensor> kept_outputs;     // the keep-outputs diagnostic's, freed at the step's end
  for (const PipeAction& a : actions) {
    ANVIL_ASSERT(a.stage == stage_, action_name(a), " on stage ", stage_);
    const size_t i = static_cast<size_t>(a.micro_batch);
    const int64_t B = tokens[i].size(0), T = tokens[i].size(1);
    if (a.op == PipeOp::forward) {
      const Tensor input = first() ? tokens[i] : receive(stage_ - 1, 2 * a.micro_batch, B, T, "pipeline.recv_activation");
      Tensor out = model_.forward(input, B, T, policy, in_flight[a.micro_batch]);
      if (!last()) send(out, stage_ + 1, 2 * a.micro_batch);
      if (last() && keep_outputs_) kept_outputs.push_back(model_.logits(in_flight[a.micro_batch]));
      continue;
    }
    auto saved = in_flight.find(a.micro_batch);
    ANVIL_ASSERT(saved != in_flight.end(), action_name(a), " before its forward");
    if (before_backward) before_backward(a.micro_batch);
    Tensor d_input;
    if (last()) {
      const CrossEntropyResult loss = model_.backward_from_loss(saved->second, targets[i], grad_scale, &d_input);
      result.loss_sum += loss.loss_sum;
      result.loss_tokens += loss.num_tokens;
    } else {
      d_input = model_.backward(saved->second,
                                receive(stage_ + 1, 2 * a.micro_batch + 1, B, T, "pipeline.recv_gradient"));
    }
    in_flight.erase(saved);  // nothing of this micro-batch outlives its backward
    if (!first()) send(d_input, stage_ - 1, 2 * a.micro_batch + 1);
  }
  ANVIL_ASSERT(in_flight.empty(), "a micro-batch ran forward without backward");
  complete_sends(/*wait=*/true);
  return result;
}

}  // namespace anvil
