#include "anvil/pipeline/executor.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <set>
#include <tuple>

#include "anvil/core/error.h"
#include "anvil/core/profiler.h"

namespace anvil {

Tensor gather_pipeline_stages(Communicator& pp, const ModelArgs& args, const PipelineSplit& split,
                              const PipePlacement& placement, const Tensor& rank_flat) {
  const int P = pp.size();
  auto rank_layout = [&](int r) {
    return ParamStore(llama_param_specs(args, pipeline_rank_modules(args, split, placement, r)), DType::f32,
                      /*allocate=*/false);
  };
  if (pp.rank() != 0) {
    pp.send(rank_flat, 0, /*tag=*/0);
    return Tensor();
  }
  const ParamStore whole(llama_param_specs(args), DType::f32, /*allocate=*/false);
  Tensor out = Tensor::zeros({whole.numel()}, DType::f32, MemCategory::workspace, "pp.global_state");
  for (int r = 0; r < P; ++r) {
    const ParamStore layout = rank_layout(r);
    Tensor part = rank_flat;
    if (r > 0) {
      part = Tensor::empty({layout.numel()}, DType::f32, MemCategory::communication, "pp.stage_state");
      pp.recv(part, r, /*tag=*/0);
    }
    for (const ParamSpec& spec : layout.specs()) {
      Tensor dst = out.slice(whole.specs()[static_cast<size_t>(whole.index_of(spec.name))].offset, spec.numel());
      dst.copy_from(part.slice(spec.offset, spec.numel()));
    }
  }
  return out;
}

std::vector<int> send_release_points(const PipeSchedule& schedule, int rank) {
  const PipeProgram& program = schedule.program;
  const PipePlacement& placement = schedule.placement;
  const int P = static_cast<int>(program.size()), S = placement.stages();
  // Where each action runs: (rank, index); B and I under one key, as
  // action_inputs names "the backward".
  auto key = [](const PipeAction& a) {
    const int op = a.op == PipeOp::forward ? 0 : a.op == PipeOp::backward_weight ? 2 : 1;
    return std::make_tuple(op, a.stage, a.micro_batch);
  };
  std::map<std::tuple<int, int, int>, std::pair<int, int>> where;
  for (int r = 0; r < P; ++r)
    for (size_t k = 0; k < program[static_cast<size_t>(r)].size(); ++k)
      where[key(program[static_cast<size_t>(r)][k])] = {r, static_cast<int>(k)};
  // Vector clocks: clock[r][k][q] = the last action of rank q known done
  // when rank r's action k has its inputs (-1: none).
  std::vector<std::vector<std::vector<int>>> clock(static_cast<size_t>(P));
  std::vector<size_t> next(static_cast<size_t>(P), 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < P; ++r) {
      const auto& actions = program[static_cast<size_t>(r)];
      auto& mine = clock[static_cast<size_t>(r)];
      for (size_t& n = next[static_cast<size_t>(r)]; n < actions.size(); ++n, progress = true) {
        std::vector<int> c = n == 0 ? std::vector<int>(static_cast<size_t>(P), -1) : mine[n - 1];
        bool ready = true;
        for (const PipeAction& in : action_inputs(actions[n], S)) {
          const auto [q, j] = where.at(key(in));
          if (static_cast<size_t>(j) >= next[static_cast<size_t>(q)]) {
            ready = false;
            break;
          }
          const std::vector<int>& theirs = clock[static_cast<size_t>(q)][static_cast<size_t>(j)];
          for (int x = 0; x < P; ++x) c[static_cast<size_t>(x)] = std::max(c[static_cast<size_t>(x)], theirs[static_cast<size_t>(x)]);
        }
        if (!ready) break;
        c[static_cast<size_t>(r)] = static_cast<int>(n);
        mine.push_back(std::move(c));
      }
    }
  }
  const auto& actions = program[static_cast<size_t>(rank)];
  ANVIL_ASSERT(next[static_cast<size_t>(rank)] == actions.size(), "the pipeline program cannot run to its end");
  std::vector<int> release(actions.size(), -1);
  for (size_t k = 0; k < actions.size(); ++k) {
    const PipeAction& a = actions[k];
    // The action that takes what this one sends, if it is on another rank.
    PipeAction taker{};
    if (a.op == PipeOp::forward && a.stage < S - 1) taker = {PipeOp::forward, a.stage + 1, a.micro_batch};
    else if ((a.op == PipeOp::backward || a.op == PipeOp::backward_input) && a.stage > 0)
      taker = {PipeOp::backward, a.stage - 1, a.micro_batch};
    else continue;
    const auto [q, j] = where.at(key(taker));
    if (q == rank) continue;
    for (size_t m = k + 1; m < actions.size(); ++m)
      if (clock[static_cast<size_t>(rank)][m][static_cast<size_t>(q)] >= j) {
        release[k] = static_cast<int>(m);
        break;
      }
  }
  return release;
}

namespace {
// Trace labels ("pipeline.1F3") must outlive the spans that point at them:
// interned once, when a stage is built.
const char* action_label(const PipeAction& a) {
  static std::mutex mutex;
  static std::set<std::string> labels;
  const std::lock_guard<std::mutex> lock(mutex);
  return labels.insert("pipeline." + action_name(a)).first->c_str();
}
}  // namespace

PipelineExecutor::PipelineExecutor(Llama& model, Communicator& pp, const PipeSchedule& schedule, bool keep_outputs)
    : model_(model),
      pp_(pp),
      placement_(schedule.placement),
      rank_(pp.rank()),
      stages_(schedule.placement.stages_of(pp.rank())),
      actions_(schedule.program[static_cast<size_t>(pp.rank())]),
      keep_outputs_(keep_outputs),
      release_at_(send_release_points(schedule, pp.rank())) {
  ANVIL_ASSERT(placement_.ranks == pp.size() && model.num_stages() == static_cast<int>(stages_.size()),
               "pp rank ", rank_, " holds ", model.num_stages(), " stages; the placement gives it ", stages_.size());
  const int S = placement_.stages();
  ANVIL_ASSERT(model.has_embedding() == on_this_rank(0) && model.has_head() == on_this_rank(S - 1));
  for (const PipeAction& a : actions_) labels_.push_back(action_label(a));
}

int PipelineExecutor::local(int stage) const {
  const auto it = std::find(stages_.begin(), stages_.end(), stage);
  ANVIL_ASSERT(it != stages_.end(), "stage ", stage, " is not on pp rank ", rank_);
  return static_cast<int>(it - stages_.begin());
}

// One tag per boundary tensor of a step (MPI keeps the order of messages with
// the same source and tag, so steps cannot mix).
int PipelineExecutor::tag(Flow flow, int to, int micro_batch) const {
  const int t = (micro_batch * placement_.stages() + to) * 2 + (flow == Flow::gradient ? 1 : 0);
  ANVIL_CHECK(t <= 32767, "pipeline message tag ", t, " exceeds the 32767 MPI guarantees; use fewer micro-batches");
  return t;
}

void PipelineExecutor::post_receive(Flow flow, int to, int micro_batch, int64_t B, int64_t T) {
  const int from = flow == Flow::activation ? to - 1 : to + 1;
  const int t = tag(flow, to, micro_batch);
  if (on_this_rank(from) || inbox_.count(t)) return;  // handed over in memory, or already posted
  Inbox& in = inbox_[t];
  in.tensor = Tensor::empty({model_.residual_rows(B * T), model_.args().dim}, model_.compute_dtype(),
                            MemCategory::activations,
                            flow == Flow::activation ? "pipeline.recv_activation" : "pipeline.recv_gradient");
  in.work = pp_.irecv(in.tensor, placement_.rank_of(from), t);
}

Tensor PipelineExecutor::take_input(Flow flow, int to, int micro_batch, int64_t B, int64_t T) {
  const int t = tag(flow, to, micro_batch);
  post_receive(flow, to, micro_batch, B, T);
  auto it = inbox_.find(t);
  ANVIL_ASSERT(it != inbox_.end(), "stage ", to, " waits for micro-batch ", micro_batch,
               "'s tensor from its own rank, which has not made it");
  if (it->second.work.pending()) {
    const ScopedPhase phase(SpanCategory::communication,
                            flow == Flow::activation ? "pipeline.wait_activation" : "pipeline.wait_gradient");
    it->second.work.wait();
  }
  Tensor out = std::move(it->second.tensor);
  inbox_.erase(it);
  return out;
}

void PipelineExecutor::hand_over(const Tensor& t, Flow flow, int to, int micro_batch, int release_at) {
  if (on_this_rank(to)) {
    inbox_[tag(flow, to, micro_batch)] = Inbox{t, Work()};
    return;
  }
  // The send reads a copy in a communication buffer: the activation (or its
  // gradient) is free at once, as on the receiving side's schedule, and only
  // the copy waits for MPI to finish with it, however long that takes. The
  // send's own span marks when the tensor left: a small message can reach the
  // other rank before this action's span ends.
  const ScopedPhase phase(SpanCategory::communication,
                          flow == Flow::activation ? "pipeline.send_activation" : "pipeline.send_gradient");
  Tensor buf = Tensor::empty(t.shape(), t.dtype(), MemCategory::communication,
                             flow == Flow::activation ? "pipeline.send_activation" : "pipeline.send_gradient");
  buf.copy_from(t);
  sends_.push_back({pp_.isend(buf, placement_.rank_of(to), tag(flow, to, micro_batch)), release_at});
}

void PipelineExecutor::release_sends(int k) {
  std::vector<Send> still;
  for (Send& s : sends_) {
    if (k >= 0 && s.release_at != k) {
      still.push_back(std::move(s));
      continue;
    }
    const ScopedPhase phase(SpanCategory::communication, "pipeline.wait_send");
    s.work.wait();  // the receiver has the tensor: returns at once, or after MPI's own last steps
  }
  sends_ = std::move(still);  // the sends waited for free their buffers here
}

void PipelineExecutor::post_receive_for(const PipeAction& a, const std::vector<Tensor>& tokens) {
  const int S = placement_.stages();
  const Tensor& x = tokens[static_cast<size_t>(a.micro_batch)];
  if (a.op == PipeOp::forward && a.stage > 0)
    post_receive(Flow::activation, a.stage, a.micro_batch, x.size(0), x.size(1));
  if ((a.op == PipeOp::backward || a.op == PipeOp::backward_input) && a.stage < S - 1)
    post_receive(Flow::gradient, a.stage, a.micro_batch, x.size(0), x.size(1));
}

CrossEntropyResult PipelineExecutor::evaluate(const Tensor& tokens, const Tensor& targets, const Tensor& documents) {
  const int64_t B = tokens.size(0), T = tokens.size(1);
  const int S = placement_.stages();
  CrossEntropyResult result;
  for (int s : stages_) {  // ascending: what a rank waits for comes from earlier stages
    StageSaved saved;  // full checkpointing: each block keeps its input only, until the stage is done
    const Tensor input = s == 0 ? tokens : take_input(Flow::activation, s, 0, B, T);
    const Tensor out = model_.forward(local(s), input, B, T, AcPolicy{AcMode::full, 1}, saved, documents);
    if (s == S - 1) result = model_.loss(saved, targets);
    else hand_over(out, Flow::activation, s + 1, 0, -1);
  }
  release_sends(-1);
  return result;
}

// What one pass carries from action to action.
struct PipelineExecutor::Pass {
  const std::vector<Tensor>& tokens;
  const std::vector<Tensor>& targets;
  const std::vector<Tensor>& documents;
  float grad_scale;
  const AcPolicy& policy;
  const std::function<void(int)>& before_backward;
  PipelineResult result;
  // (stage, micro-batch) → its saved state, from its forward to its backward (its W pass when split).
  std::map<std::pair<int, int>, StageSaved> in_flight;
  std::vector<Tensor> kept_outputs;  // the keep-outputs diagnostic's, freed at the step's end
};

PipelineResult PipelineExecutor::run(const std::vector<Tensor>& tokens, const std::vector<Tensor>& targets,
                                  float grad_scale, const AcPolicy& policy,
                                  const std::function<void(int)>& before_backward,
                                  const std::vector<Tensor>& documents) {
  // The traces' pass and action spans are what bench/pipeline_bubbles.py
  // measures bubbles from: idle = the pass − its actions + their waits.
  const ScopedPhase span(SpanCategory::step, "pipeline.pass");
  ANVIL_ASSERT(documents.empty() || documents.size() == tokens.size(), documents.size(), " micro-batches' documents for ",
               tokens.size());
  Pass pass{tokens, targets, documents, grad_scale, policy, before_backward, {}, {}, {}};
  // The receive an action needs is posted when the action before it is done
  // (its temporaries freed), so the tensor can arrive while this rank sends
  // and while it would otherwise wait; earlier, its buffer would add to the
  // peak of the action before. (The first action's is posted as it starts.)
  for (size_t k = 0; k < actions_.size(); ++k) {
    run_action(k, pass);
    if (k + 1 < actions_.size()) post_receive_for(actions_[k + 1], tokens);
  }
  ANVIL_ASSERT(pass.in_flight.empty(), "a micro-batch ran forward without its whole backward");
  ANVIL_ASSERT(inbox_.empty(), "a boundary tensor was received and never used");
  release_sends(-1);
  return pass.result;
}

void PipelineExecutor::run_action(size_t k, Pass& pass) {
  const PipeAction& a = actions_[k];
  const int S = placement_.stages();
  const int i = a.micro_batch, l = local(a.stage);
  const Tensor& x = pass.tokens[static_cast<size_t>(i)];
  const int64_t B = x.size(0), T = x.size(1);
  const ScopedPhase span(SpanCategory::step, labels_[k]);
  const int release_at = release_at_[k];
  if (a.op == PipeOp::forward) {
    const Tensor input = a.stage == 0 ? x : take_input(Flow::activation, a.stage, i, B, T);
    release_sends(static_cast<int>(k));  // what this action's input proves received
    StageSaved& saved = pass.in_flight[{a.stage, i}];
    const Tensor documents = pass.documents.empty() ? Tensor() : pass.documents[static_cast<size_t>(i)];
    Tensor out = model_.forward(l, input, B, T, pass.policy, saved, documents);
    if (a.stage < S - 1) hand_over(out, Flow::activation, a.stage + 1, i, release_at);
    else if (keep_outputs_) pass.kept_outputs.push_back(model_.logits(saved));
    return;
  }
  auto saved = pass.in_flight.find({a.stage, i});
  ANVIL_ASSERT(saved != pass.in_flight.end(), action_name(a), " before its forward");
  if (pass.before_backward) pass.before_backward(i);
  if (a.op == PipeOp::backward_weight) {
    release_sends(static_cast<int>(k));
    model_.backward_weight(l, saved->second);
    pass.in_flight.erase(saved);  // nothing of this micro-batch outlives its W pass
    return;
  }
  const auto part = a.op == PipeOp::backward_input ? Llama::BackwardPart::input : Llama::BackwardPart::whole;
  Tensor d_input;
  Tensor d_output = a.stage == S - 1 ? Tensor() : take_input(Flow::gradient, a.stage, i, B, T);
  release_sends(static_cast<int>(k));
  if (a.stage == S - 1) {
    const CrossEntropyResult loss = model_.backward_from_loss(l, saved->second, pass.targets[static_cast<size_t>(i)],
                                                              pass.grad_scale, &d_input, part);
    pass.result.loss_sum += loss.loss_sum;
    pass.result.loss_tokens += loss.num_tokens;
  } else {
    d_input = model_.backward(l, saved->second, std::move(d_output), part);
  }
  if (a.op == PipeOp::backward) pass.in_flight.erase(saved);  // nothing of this micro-batch outlives its backward
  if (a.stage > 0) hand_over(d_input, Flow::gradient, a.stage - 1, i, release_at);
}

}  // namespace anvil
