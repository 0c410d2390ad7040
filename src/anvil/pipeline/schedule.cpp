#include "anvil/pipeline/schedule.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>

#include "anvil/core/error.h"

namespace anvil {

std::vector<PipeAction> action_inputs(const PipeAction& a, int stages) {
  switch (a.op) {
    case PipeOp::forward:
      if (a.stage == 0) return {};
      return {{PipeOp::forward, a.stage - 1, a.micro_batch}};
    case PipeOp::backward_weight: return {{PipeOp::backward_input, a.stage, a.micro_batch}};
    case PipeOp::backward:
    case PipeOp::backward_input:
      if (a.stage == stages - 1) return {{PipeOp::forward, a.stage, a.micro_batch}};
      return {{PipeOp::forward, a.stage, a.micro_batch}, {PipeOp::backward, a.stage + 1, a.micro_batch}};
  }
  return {};
}

std::string action_name(const PipeAction& a) {
  return std::to_string(a.stage) + static_cast<char>(a.op) + std::to_string(a.micro_batch);
}

std::vector<int> PipePlacement::stages_of(int rank) const {
  std::vector<int> out;
  for (int s = 0; s < stages(); ++s)
    if (rank_of(s) == rank) out.push_back(s);
  return out;
}

PipePlacement looped_placement(int ranks, int stages_per_rank) {
  PipePlacement p;
  p.ranks = ranks;
  for (int s = 0; s < ranks * stages_per_rank; ++s) p.rank_of_stage.push_back(s % ranks);
  return p;
}

PipePlacement v_placement(int ranks) {
  PipePlacement p;
  p.ranks = ranks;
  for (int s = 0; s < 2 * ranks; ++s) p.rank_of_stage.push_back(s < ranks ? s : 2 * ranks - 1 - s);
  return p;
}

namespace {

const char* const kScheduleNames = "GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble";
const char* const kMicroBatchKeys =
    "raise training.local_batch_size or lower parallelism.pipeline_parallel_microbatch_size "
    "(micro-batches = local_batch_size / pipeline_parallel_microbatch_size)";

std::vector<PipeAction>& row(PipeProgram& program, int r) { return program[static_cast<size_t>(r)]; }

// ---- one stage per rank --------------------------------------------------

PipeProgram gpipe(int P, int m) {
  PipeProgram program(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r) {
    for (int i = 0; i < m; ++i) row(program, r).push_back({PipeOp::forward, r, i});
    for (int i = 0; i < m; ++i) row(program, r).push_back({PipeOp::backward, r, i});
  }
  return program;
}

PipeProgram one_f_one_b(int P, int m) {
  PipeProgram program(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r) {
    std::vector<PipeAction>& a = row(program, r);
    const int warmup = std::min(P - 1 - r, m);
    for (int i = 0; i < warmup; ++i) a.push_back({PipeOp::forward, r, i});
    for (int i = 0; i < m - warmup; ++i) {  // steady state: one forward, one backward
      a.push_back({PipeOp::forward, r, warmup + i});
      a.push_back({PipeOp::backward, r, i});
    }
    for (int i = m - warmup; i < m; ++i) a.push_back({PipeOp::backward, r, i});
  }
  return program;
}

// ---- V stages per rank, looped (stage s on rank s mod P) -----------------

// Megatron's virtual pipeline order: rank r's k-th forward runs chunk
// (k / P) mod V on micro-batch (k / PV)·P + k mod P, i.e. rounds of P
// micro-batches go through the rank's first stage, then its second, ...; the
// k-th backward walks the chunks in reverse. The warm-up is what the last
// stage needs before its first backward ((V−1)·P forwards) plus two per hop
// from the last rank (a forward there and a backward back).
struct InterleavedOrder {
  int P, V, m;
  PipeAction forward(int r, int k) const { return {PipeOp::forward, chunk(k) * P + r, micro_batch(k)}; }
  PipeAction backward(int r, int k) const { return {PipeOp::backward, (V - 1 - chunk(k)) * P + r, micro_batch(k)}; }
  int warmup(int r) const { return std::min((P - r - 1) * 2 + (V - 1) * P, m * V); }
  int chunk(int k) const { return (k / P) % V; }
  int micro_batch(int k) const { return (k / (P * V)) * P + k % P; }
};

PipeProgram interleaved_1f1b(int P, int V, int m) {
  const InterleavedOrder o{P, V, m};
  PipeProgram program(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r) {
    std::vector<PipeAction>& a = row(program, r);
    const int warmup = o.warmup(r), total = m * V;
    for (int k = 0; k < warmup; ++k) a.push_back(o.forward(r, k));
    for (int k = 0; k < total - warmup; ++k) {
      a.push_back(o.forward(r, warmup + k));
      a.push_back(o.backward(r, k));
    }
    for (int k = total - warmup; k < total; ++k) a.push_back(o.backward(r, k));
  }
  return program;
}

// ZB-H1 on the interleaved order: each B becomes I (what the previous stage
// waits for) followed, later, by W (which nobody waits for). The W's go into
// a FIFO; in the steady state rank r keeps up to r of them pending, in the
// cooldown it runs one per I (filling the wait for the next stage's I), and
// the last r close the row. Why r: the step ends with stage 0's last I on
// rank 0, and rank r's last I comes r hops (one I each) before it, so rank r
// can run r W's after its last I without lengthening the step, and rank 0
// none. With F = I = W = 1 the simulated step is 3·V·m + P − 1 (bubble
// (P−1)/(3·V·m + P − 1), a third of Interleaved1F1B's bubble time; the tests
// check it). A micro-batch-stage's saved state lives until its W, so rank r
// holds at most min(warmup(r) + 1 + r, V·m) of them, Interleaved1F1B's
// min(warmup(r) + 1, V·m) plus r; rank 0's, the largest, is unchanged.
int interleaved_zb_deferred_w(int r) { return r; }

PipeProgram interleaved_zero_bubble(int P, int V, int m) {
  const InterleavedOrder o{P, V, m};
  PipeProgram program(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r) {
    std::vector<PipeAction>& a = row(program, r);
    const int warmup = o.warmup(r), total = m * V, keep = interleaved_zb_deferred_w(r);
    std::deque<PipeAction> pending;
    auto input_grad = [&](int k) {
      PipeAction b = o.backward(r, k);
      a.push_back({PipeOp::backward_input, b.stage, b.micro_batch});
      pending.push_back({PipeOp::backward_weight, b.stage, b.micro_batch});
    };
    auto weight_grad = [&] {
      a.push_back(pending.front());
      pending.pop_front();
    };
    for (int k = 0; k < warmup; ++k) a.push_back(o.forward(r, k));
    for (int k = 0; k < total - warmup; ++k) {
      a.push_back(o.forward(r, warmup + k));
      input_grad(k);
      while (static_cast<int>(pending.size()) > keep) weight_grad();
    }
    for (int k = total - warmup; k < total; ++k) {
      input_grad(k);
      weight_grad();
    }
    while (!pending.empty()) weight_grad();
  }
  return program;
}

PipeProgram looped_bfs(int P, int V, int m) {
  const PipePlacement placement = looped_placement(P, V);
  PipeProgram program(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r) {
    const std::vector<int> stages = placement.stages_of(r);
    for (int s : stages)
      for (int i = 0; i < m; ++i) row(program, r).push_back({PipeOp::forward, s, i});
    for (auto s = stages.rbegin(); s != stages.rend(); ++s)
      for (int i = 0; i < m; ++i) row(program, r).push_back({PipeOp::backward, *s, i});
  }
  return program;
}

// ---- ZB-V ------------------------------------------------------------------

// ZB-V built by a greedy list scheduler over a run with the stages' costs
// (unit costs when none are given; messages instant): whenever a rank is free
// it takes, among the actions whose inputs have arrived, first an I (another
// rank waits for it), then an F (the up leg of the V before the down leg,
// since it leads to the loss), then the oldest pending W (nobody waits for it,
// so it fills what would be idle time); with nothing to take it waits for the
// next action anywhere to finish. A new micro-batch enters a rank's down leg
// only while the rank holds, counting the up-leg stage each started
// micro-batch will still need, fewer than 2P micro-batch-stages (F run, W not
// yet): P micro-batches' worth of the rank's layers, 1F1B's bound on rank 0.
// What the simulated ranks ran, in order, is the program. Costs matter: the
// stage holding the head runs the head's whole fused pass in its I, and a
// program built for equal costs puts that long I on every micro-batch's path.
PipeProgram zbv_zero_bubble(int P, int m, const std::vector<PipeCosts>& costs) {
  const int S = 2 * P, cap = 2 * P;
  auto at = [m](int s, int i) { return static_cast<size_t>(s * m + i); };
  auto cost = [&](PipeOp op, int s) {
    const PipeCosts& c = costs[static_cast<size_t>(s)];
    return op == PipeOp::forward ? c.forward : op == PipeOp::backward_input ? c.backward_input : c.backward_weight;
  };
  std::vector<double> f_end(static_cast<size_t>(S * m), -1), i_end(f_end);  // finish times; -1: not run
  std::vector<int> next_f(static_cast<size_t>(S), 0), next_i(next_f);       // per stage, in micro-batch order
  std::vector<int> in_flight(static_cast<size_t>(P), 0);
  std::vector<double> free_at(static_cast<size_t>(P), 0);
  std::vector<std::deque<PipeAction>> pending_w(static_cast<size_t>(P));
  PipeProgram program(static_cast<size_t>(P));
  // Rank r, free at time t, takes an action if it has one; false if not.
  auto try_act = [&](int r, double t) {
    auto done_by = [t](double end) { return end >= 0 && end <= t; };
    // The next F or I of stage s, its inputs finished by t (a backward input is an I here).
    auto ready = [&](PipeOp op, int s) {
      const int i = (op == PipeOp::forward ? next_f : next_i)[static_cast<size_t>(s)];
      if (i >= m) return false;
      for (const PipeAction& in : action_inputs({op, s, i}, S))
        if (!done_by((in.op == PipeOp::forward ? f_end : i_end)[at(in.stage, in.micro_batch)])) return false;
      return true;
    };
    auto input_ready = [&](int s) { return ready(PipeOp::backward_input, s); };
    auto forward_ready = [&](int s) { return ready(PipeOp::forward, s); };
    const int down = r, up = S - 1 - r;
    int& held = in_flight[static_cast<size_t>(r)];
    std::deque<PipeAction>& w = pending_w[static_cast<size_t>(r)];
    auto run = [&](PipeOp op, int s) {
      const bool fwd = op == PipeOp::forward;
      const PipeAction act{op, s, (fwd ? next_f : next_i)[static_cast<size_t>(s)]++};
      free_at[static_cast<size_t>(r)] = t + cost(op, s);
      (fwd ? f_end : i_end)[at(s, act.micro_batch)] = t + cost(op, s);
      if (fwd) ++held;
      if (!fwd) w.push_back({PipeOp::backward_weight, s, act.micro_batch});
      row(program, r).push_back(act);
    };
    // Micro-batches in the down leg whose up-leg forward is still to come.
    const int reserved = next_f[static_cast<size_t>(down)] - next_f[static_cast<size_t>(up)];
    const bool up_i = input_ready(up), down_i = input_ready(down);
    if (up_i || down_i) {  // the oldest micro-batch first, the up leg on a tie
      const bool pick_up = up_i && (!down_i || next_i[static_cast<size_t>(up)] <= next_i[static_cast<size_t>(down)]);
      run(PipeOp::backward_input, pick_up ? up : down);
    } else if (forward_ready(up)) {
      run(PipeOp::forward, up);
    } else if (forward_ready(down) && held + reserved + 2 <= cap) {  // its down and its up stage
      run(PipeOp::forward, down);
    } else if (!w.empty()) {
      const PipeAction act = w.front();
      w.pop_front();
      free_at[static_cast<size_t>(r)] = t + cost(PipeOp::backward_weight, act.stage);
      row(program, r).push_back(act);
      --held;
    } else {
      return false;
    }
    return true;
  };
  for (int left = P * 6 * m; left > 0;) {
    // The ranks free first decide next, the lowest first; when none of them
    // can act they wait for the next action anywhere to finish.
    const double t = *std::min_element(free_at.begin(), free_at.end());
    bool acted = false;
    for (int r = 0; r < P && !acted; ++r)
      if (free_at[static_cast<size_t>(r)] == t) acted = try_act(r, t);
    if (acted) {
      --left;
      continue;
    }
    double next = -1;
    for (const std::vector<double>* ends : {&f_end, &i_end, &free_at})
      for (double end : *ends)
        if (end > t && (next < 0 || end < next)) next = end;
    ANVIL_ASSERT(next > t, "the ZB-V list scheduler made no progress");
    for (double& f : free_at)
      if (f == t) f = next;
  }
  return program;
}

// ---- checking --------------------------------------------------------------

// Where an action sits, for messages: a program's rank and index, or a CSV
// file's row and column.
using Locate = std::function<std::string(int rank, int index)>;

int slot_index(const PipeAction& a, int m) { return a.stage * m + a.micro_batch; }

namespace {

// Where each (stage, micro-batch)'s F, B, I and W run in a program:
// {rank, index}, or {-1, -1} when no rank runs it; and how to name a cell.
struct ProgramIndex {
  using Pos = std::pair<int, int>;
  const PipeProgram& program;
  const Locate& where;
  std::string name;  // "pipeline schedule 1F1B"
  int S, m;
  std::vector<Pos> pos_f, pos_b, pos_i, pos_w;

  std::vector<Pos>& of(PipeOp op) {
    switch (op) {
      case PipeOp::forward: return pos_f;
      case PipeOp::backward: return pos_b;
      case PipeOp::backward_input: return pos_i;
      default: return pos_w;
    }
  }
  const PipeAction& action(int r, int k) const {
    return program[static_cast<size_t>(r)][static_cast<size_t>(k)];
  }
  std::string cell(int r, int k) const {  // "rank 1 runs 3I0 (action 5 of its row)"
    return detail::concat("rank ", r, " runs ", action_name(action(r, k)), " (", where(r, k), ")");
  }
  std::string at(const Pos& p) const { return cell(p.first, p.second); }
  std::string ref(const Pos& p) const {  // "rank 1's 3I0 (action 5 of its row)"
    return detail::concat("rank ", p.first, "'s ", action_name(action(p.first, p.second)), " (",
                          where(p.first, p.second), ")");
  }
};

// Every action names a stage of its rank and a micro-batch of the step, once.
ProgramIndex index_program(const PipeSchedule& schedule, int m, const Locate& where, const std::string& name) {
  const PipeProgram& program = schedule.program;
  const PipePlacement& placement = schedule.placement;
  const int S = placement.stages();
  const size_t slots = static_cast<size_t>(S * m);
  ProgramIndex ix{program, where, name, S, m, {}, {}, {}, {}};
  ix.pos_f.assign(slots, {-1, -1});
  ix.pos_b = ix.pos_i = ix.pos_w = ix.pos_f;
  for (int r = 0; r < static_cast<int>(program.size()); ++r)
    for (int k = 0; k < static_cast<int>(program[static_cast<size_t>(r)].size()); ++k) {
      const PipeAction& a = ix.action(r, k);
      ANVIL_CHECK(a.stage >= 0 && a.stage < S, name, ": ", ix.cell(r, k), ", but the schedule has stages 0 to ", S - 1);
      ANVIL_CHECK(placement.rank_of(a.stage) == r, name, ": ", ix.cell(r, k), ", but stage ", a.stage, " is on rank ",
                  placement.rank_of(a.stage));
      ANVIL_CHECK(a.micro_batch >= 0 && a.micro_batch < m, name, ": ", ix.cell(r, k),
                  ", but the step has micro-batches 0 to ", m - 1);
      ProgramIndex::Pos& p = ix.of(a.op)[static_cast<size_t>(slot_index(a, m))];
      ANVIL_CHECK(p.first < 0, name, ": ", ix.cell(r, k), " a second time; it first ran at ", where(p.first, p.second));
      p = {r, k};
    }
  return ix;
}

// Every stage runs F of every micro-batch and either its B or its I then its W.
void check_complete(const ProgramIndex& ix) {
  const std::string& name = ix.name;
  for (int s = 0; s < ix.S; ++s)
    for (int i = 0; i < ix.m; ++i) {
      const size_t x = static_cast<size_t>(s * ix.m + i);
      // `why`: what needs the missing action, when something does.
      auto missing = [&](PipeOp op, const std::string& why = "") {
        return detail::concat(name, ": no rank runs ", action_name({op, s, i}), why,
                              "; every stage runs F of every micro-batch and either B or both I and W");
      };
      const auto &f = ix.pos_f[x], &b = ix.pos_b[x], &in = ix.pos_i[x], &w = ix.pos_w[x];
      ANVIL_CHECK(f.first >= 0, missing(PipeOp::forward));
      ANVIL_CHECK(b.first < 0 || (in.first < 0 && w.first < 0), name, ": ", ix.at(b), ", and ",
                  ix.at(in.first >= 0 ? in : w), "; a backward is either one B or one I and one W, not both");
      if (b.first >= 0) continue;
      ANVIL_CHECK(in.first >= 0 || w.first >= 0, missing(PipeOp::backward));
      ANVIL_CHECK(in.first >= 0, missing(PipeOp::backward_input, ", which " + ix.ref(w) + " needs"));
      ANVIL_CHECK(w.first >= 0, missing(PipeOp::backward_weight, " after " + ix.ref(in)));
      ANVIL_CHECK(w.second > in.second, name, ": ", ix.at(w), " before its ", action_name({PipeOp::backward_input, s, i}),
                  " (", ix.where(in.first, in.second), "); a W uses what its I computed");
    }
}

// Runs the program: a rank waits only to receive (sends never block); an
// action waits for its inputs (action_inputs). Every rank must reach its end.
void check_deadlock_free(ProgramIndex& ix) {
  const PipeProgram& program = ix.program;
  const int P = static_cast<int>(program.size()), S = ix.S, m = ix.m;
  const size_t slots = static_cast<size_t>(S * m);
  std::vector<char> done_f(slots, 0), done_back(slots, 0);  // done_back: the B or the I
  auto awaited = [&](const PipeAction& a) -> PipeAction {  // the first input not done; {op, -1, -1} when ready
    for (const PipeAction& in : action_inputs(a, S)) {
      const size_t y = static_cast<size_t>(slot_index(in, m));
      if ((in.op == PipeOp::forward ? done_f : done_back)[y]) continue;
      if (in.op != PipeOp::backward) return in;
      return {ix.pos_b[y].first >= 0 ? PipeOp::backward : PipeOp::backward_input, in.stage, in.micro_batch};
    }
    return {a.op, -1, -1};
  };
  std::vector<size_t> next(static_cast<size_t>(P), 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < P; ++r) {
      const std::vector<PipeAction>& actions = program[static_cast<size_t>(r)];
      size_t& n = next[static_cast<size_t>(r)];
      for (; n < actions.size() && awaited(actions[n]).stage < 0; ++n, progress = true) {
        const size_t x = static_cast<size_t>(slot_index(actions[n], m));
        if (actions[n].op == PipeOp::forward) done_f[x] = 1;
        if (actions[n].op == PipeOp::backward || actions[n].op == PipeOp::backward_input) done_back[x] = 1;
      }
    }
  }
  std::string blocked;
  for (int r = 0; r < P; ++r) {
    const size_t n = next[static_cast<size_t>(r)];
    if (n == program[static_cast<size_t>(r)].size()) continue;
    const PipeAction w = awaited(program[static_cast<size_t>(r)][n]);
    const ProgramIndex::Pos p = ix.of(w.op)[static_cast<size_t>(slot_index(w, m))];
    blocked += detail::concat(blocked.empty() ? "" : "; ", ix.cell(r, static_cast<int>(n)), " waits for ",
                              action_name(w), ", which rank ", p.first, " runs later (", ix.where(p.first, p.second),
                              ")");
  }
  ANVIL_CHECK(blocked.empty(), ix.name, " deadlocks: ", blocked,
              ". A forward waits for the previous stage's forward of its micro-batch, a backward (B or I) for "
              "its own forward and the next stage's backward, a W for its I; reorder the rows so that what "
              "each rank waits for comes first");
}

}  // namespace

void check_schedule(const PipeSchedule& schedule, int m, const Locate& where) {
  const int P = static_cast<int>(schedule.program.size()), S = schedule.placement.stages();
  const std::string name = schedule.name.empty() ? "the pipeline schedule" : "pipeline schedule " + schedule.name;
  ANVIL_CHECK(schedule.placement.ranks == P, name, " has ", P, " rows of actions for ", schedule.placement.ranks,
              " pipeline ranks; it needs one row per rank");
  ANVIL_CHECK(m >= 1 && S >= 1, name, " needs at least one stage and one micro-batch");
  ProgramIndex ix = index_program(schedule, m, where, name);
  check_complete(ix);
  check_deadlock_free(ix);
}

Locate program_positions() {
  return [](int r, int k) { return detail::concat("action ", k, " of its row"); };
}

// ---- CSV -------------------------------------------------------------------

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\r"), e = s.find_last_not_of(" \t\r");
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

// "<stage><F|B|I|W><micro-batch>", non-negative decimal numbers.
bool parse_cell(const std::string& text, PipeAction& out) {
  size_t k = 0;
  auto number = [&](int& value) {
    const size_t start = k;
    long long v = 0;
    while (k < text.size() && text[k] >= '0' && text[k] <= '9' && k - start < 9) v = v * 10 + (text[k++] - '0');
    value = static_cast<int>(v);
    return k > start && (k == text.size() || text[k] < '0' || text[k] > '9');
  };
  if (!number(out.stage) || k == text.size()) return false;
  const char op = text[k++];
  if (op != 'F' && op != 'B' && op != 'I' && op != 'W') return false;
  out.op = static_cast<PipeOp>(op);
  return number(out.micro_batch) && k == text.size();
}

}  // namespace

int schedule_stages_per_rank(const std::string& name, int requested) {
  if (name == "GPipe" || name == "1F1B") {
    ANVIL_CHECK(requested <= 1, "the ", name, " schedule runs one stage per rank, but ", requested,
                " stages per rank were asked for; Interleaved1F1B, LoopedBFS and InterleavedZeroBubble run "
                "several (ZBVZeroBubble two)");
    return 1;
  }
  if (name == "ZBVZeroBubble") {
    ANVIL_CHECK(requested <= 0 || requested == 2, "the ZBVZeroBubble schedule runs two stages per rank (a V), but ",
                requested,
                " stages per rank were asked for; Interleaved1F1B, LoopedBFS and InterleavedZeroBubble "
                "run any number from two");
    return 2;
  }
  if (name == "Interleaved1F1B" || name == "LoopedBFS" || name == "InterleavedZeroBubble") {
    const int v = requested <= 0 ? 2 : requested;
    ANVIL_CHECK(v >= 2, "the ", name, " schedule runs two or more stages per rank, but ", requested,
                " was asked for; use 1F1B for one stage per rank");
    return v;
  }
  throw Error(detail::concat("parallelism.pipeline_parallel_schedule = \"", name, "\" is not one of: ", kScheduleNames,
                             " (or give a schedule file with "
                             "parallelism.pipeline_parallel_schedule_csv)"));
}

PipeSchedule make_pipeline_schedule(const std::string& name, int ranks, int stages_per_rank, int micro_batches,
                                    const std::vector<PipeCosts>& stage_costs) {
  const int P = ranks, V = schedule_stages_per_rank(name, stages_per_rank), m = micro_batches;
  ANVIL_CHECK(P >= 1 && m >= 1, "a pipeline needs at least one rank and one micro-batch, not ", P, " and ", m);
  auto need_at_least = [&](int needed, const std::string& why) {
    ANVIL_CHECK(m >= needed, "the ", name, " schedule over ", P, " pipeline ranks needs at least ", needed,
                " micro-batches per step", why, ", but this step has ", m, "; ", kMicroBatchKeys, ", or use GPipe");
  };
  auto need_multiple_of_ranks = [&] {
    need_at_least(P, ", one per rank");
    ANVIL_CHECK(m % P == 0, "the ", name, " schedule over ", P, " pipeline ranks runs micro-batches in rounds of ", P,
                ", so it needs a multiple of ", P, " micro-batches per step (", P, ", ", 2 * P, ", ", 3 * P,
                ", ...), but this step has ", m, "; ", kMicroBatchKeys, ", or use 1F1B or LoopedBFS");
  };
  PipeSchedule s;
  s.name = name;
  s.placement = looped_placement(P, V);
  if (name == "GPipe") {
    s.program = gpipe(P, m);
  } else if (name == "1F1B") {
    need_at_least(P, ", one per stage");
    s.program = one_f_one_b(P, m);
  } else if (name == "Interleaved1F1B") {
    need_multiple_of_ranks();
    s.program = interleaved_1f1b(P, V, m);
  } else if (name == "InterleavedZeroBubble") {
    need_multiple_of_ranks();
    s.program = interleaved_zero_bubble(P, V, m);
  } else if (name == "LoopedBFS") {
    s.program = looped_bfs(P, V, m);
  } else {  // ZBVZeroBubble (schedule_stages_per_rank refused any other name)
    need_at_least(P, ", one per rank");
    s.placement = v_placement(P);
    ANVIL_ASSERT(stage_costs.empty() || static_cast<int>(stage_costs.size()) == 2 * P, stage_costs.size(),
                 " stage costs for ", 2 * P, " stages");
    s.program = zbv_zero_bubble(P, m, stage_costs.empty() ? std::vector<PipeCosts>(2 * P) : stage_costs);
  }
  check_schedule(s, m, program_positions());
  return s;
}

void check_pipeline_schedule(const PipeSchedule& schedule, int micro_batches) {
  check_schedule(schedule, micro_batches, program_positions());
}

PipeSchedule parse_pipeline_schedule_csv(const std::string& text, const std::string& where, int ranks,
                                         int micro_batches) {
  std::vector<std::string> lines;
  for (size_t b = 0;;) {
    const size_t e = text.find('\n', b);
    lines.push_back(text.substr(b, e == std::string::npos ? std::string::npos : e - b));
    if (e == std::string::npos) break;
    b = e + 1;
  }
  if (lines.size() > 1 && trim(lines.back()).empty()) lines.pop_back();  // the last line's newline
  const int P = ranks;
  ANVIL_CHECK(static_cast<int>(lines.size()) == P, where, " has ", lines.size(), " rows, but the pipeline has ", P,
              " ranks (parallelism.pipeline_parallel_degree); it needs one row of actions per rank");

  PipeSchedule s;
  s.name = where;
  s.program.resize(static_cast<size_t>(P));
  std::vector<std::vector<int>> columns(static_cast<size_t>(P));  // each action's 1-based column
  auto cell_at = [&](int r, int c, const std::string& text) {
    return detail::concat(where, " row ", r + 1, ", column ", c, " (\"", text, "\")");
  };
  std::map<int, std::pair<int, int>> first_seen;  // stage -> {rank, column} where it first appears
  for (int r = 0; r < P; ++r) {
    std::istringstream cells(lines[static_cast<size_t>(r)]);
    std::string raw;
    for (int c = 1; std::getline(cells, raw, ','); ++c) {
      const std::string text = trim(raw);
      if (text.empty()) continue;
      PipeAction a{};
      ANVIL_CHECK(parse_cell(text, a), cell_at(r, c, text),
                  " is not an action Anvil runs: a cell is <stage><F|B|I|W><micro-batch>, such as 0F3 (forward), "
                  "1B0 (backward), 1I0 (input gradient) or 1W0 (weight gradient); sends, receives and "
                  "unsharding are implied by the schedule and are not written");
      std::pair<int, int>& seen = first_seen.try_emplace(a.stage, -1, 0).first->second;
      ANVIL_CHECK(seen.first < 0 || seen.first == r, cell_at(r, c, text), " runs stage ", a.stage, " on rank ", r,
                  ", but row ", seen.first + 1, " (rank ", seen.first, ") runs it too, first at column ", seen.second,
                  "; a stage lives on one rank");
      if (seen.first < 0) seen = {r, c};
      s.program[static_cast<size_t>(r)].push_back(a);
      columns[static_cast<size_t>(r)].push_back(c);
    }
  }
  ANVIL_CHECK(!first_seen.empty(), where, " has no actions");
  const int S = first_seen.rbegin()->first + 1;
  s.placement.ranks = P;
  for (int st = 0; st < S; ++st) {
    const auto found = first_seen.find(st);
    ANVIL_CHECK(found != first_seen.end(), where, " runs stages up to ", S - 1, " but no row runs stage ", st,
                "; the stages are numbered 0 to S − 1 without gaps");
    s.placement.rank_of_stage.push_back(found->second.first);
  }
  for (int r = 0; r < P; ++r) {
    const std::vector<int> held = s.placement.stages_of(r);
    ANVIL_CHECK(S % P == 0, where, " runs ", S, " stages, which ", P,
                " ranks cannot share evenly; every rank holds the same number of stages");
    ANVIL_CHECK(static_cast<int>(held.size()) * P == S, where, " row ", r + 1, " (rank ", r, ") runs ", held.size(),
                " stages, but ", S, " stages over ", P, " ranks means ", S / P, " on every rank");
  }
  check_schedule(s, micro_batches, [&](int r, int k) {
    const int c = columns[static_cast<size_t>(r)][static_cast<size_t>(k)];
    return detail::concat(where, " row ", r + 1, ", column ", c);
  });
  return s;
}

PipeSchedule read_pipeline_schedule_csv(const std::string& path, int ranks, int micro_batches) {
  std::ifstream in(path, std::ios::binary);
  ANVIL_CHECK(in, "cannot open the pipeline schedule ", path,
              " (parallelism.pipeline_parallel_schedule_csv): ", std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  return parse_pipeline_schedule_csv(text.str(), path, ranks, micro_batches);
}

std::string format_pipeline_csv(const PipeProgram& program) {
  std::string out;
  for (const std::vector<PipeAction>& actions : program) {
    for (size_t k = 0; k < actions.size(); ++k) {
      if (k) out += ',';
      out += action_name(actions[k]);
    }
    out += '\n';
  }
  return out;
}

int max_in_flight(const std::vector<PipeAction>& row) {
  int now = 0, most = 0;
  for (const PipeAction& a : row) {
    if (a.op == PipeOp::forward) most = std::max(most, ++now);
    if (a.op == PipeOp::backward || a.op == PipeOp::backward_weight) --now;
  }
  return most;
}

std::vector<int> stage_in_flight(const PipeSchedule& schedule) {
  std::vector<int> now(static_cast<size_t>(schedule.placement.stages()), 0), most = now;
  for (const std::vector<PipeAction>& row : schedule.program)
    for (const PipeAction& a : row) {
      int& n = now[static_cast<size_t>(a.stage)];
      int& m = most[static_cast<size_t>(a.stage)];
      if (a.op == PipeOp::forward) m = std::max(m, ++n);
      if (a.op == PipeOp::backward || a.op == PipeOp::backward_weight) --n;
    }
  return most;
}

PipeTimeline simulate_pipeline_schedule(const PipeSchedule& schedule, const PipeCosts& costs) {
  return simulate_pipeline_schedule(schedule, std::vector<PipeCosts>(static_cast<size_t>(schedule.placement.stages()), costs));
}

PipeTimeline simulate_pipeline_schedule(const PipeSchedule& schedule, const std::vector<PipeCosts>& stage_costs) {
  const PipeProgram& program = schedule.program;
  const int P = static_cast<int>(program.size()), S = schedule.placement.stages();
  int m = 0;
  for (const std::vector<PipeAction>& actions : program)
    for (const PipeAction& a : actions) m = std::max(m, a.micro_batch + 1);
  check_pipeline_schedule(schedule, m);  // what follows indexes by stage and micro-batch
  // Finish times of each (stage, micro-batch)'s forward and backward (B or
  // I); negative until it has run. The dependencies are the checker's.
  const size_t slots = static_cast<size_t>(S * m);
  std::vector<double> f_end(slots, -1), back_end(slots, -1);
  auto slot = [&](const PipeAction& a) { return static_cast<size_t>(a.stage * m + a.micro_batch); };
  auto cost = [&](PipeOp op, int stage) {
    const PipeCosts& costs = stage_costs[static_cast<size_t>(stage)];
    switch (op) {
      case PipeOp::forward:
        return costs.forward;
      case PipeOp::backward:
        return costs.backward_input + costs.backward_weight;
      case PipeOp::backward_input:
        return costs.backward_input;
      default:
        return costs.backward_weight;
    }
  };
  // When the action's inputs (action_inputs) are all there, or -1 when one has not been computed yet.
  auto input_time = [&](const PipeAction& a) -> double {
    double ready = 0;
    for (const PipeAction& in : action_inputs(a, S)) {
      const double end = (in.op == PipeOp::forward ? f_end : back_end)[slot(in)];
      if (end < 0) return -1;
      ready = std::max(ready, end);
    }
    return ready;
  };
  PipeTimeline t;
  t.busy.assign(static_cast<size_t>(P), 0);
  std::vector<double> free_at(static_cast<size_t>(P), 0);
  std::vector<size_t> next(static_cast<size_t>(P), 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < P; ++r) {
      const std::vector<PipeAction>& actions = program[static_cast<size_t>(r)];
      for (size_t& n = next[static_cast<size_t>(r)]; n < actions.size(); ++n, progress = true) {
        const PipeAction& a = actions[n];
        const double ready = input_time(a);
        if (ready < 0) break;
        double& free = free_at[static_cast<size_t>(r)];
        free = std::max(free, ready) + cost(a.op, a.stage);
        t.busy[static_cast<size_t>(r)] += cost(a.op, a.stage);
        if (a.op == PipeOp::forward) f_end[slot(a)] = free;
        if (a.op == PipeOp::backward || a.op == PipeOp::backward_input) back_end[slot(a)] = free;
        t.makespan = std::max(t.makespan, free);
      }
    }
  }
  for (int r = 0; r < P; ++r)
    ANVIL_ASSERT(next[static_cast<size_t>(r)] == program[static_cast<size_t>(r)].size(),
                 "the simulation stalled on a schedule the checker ran to the end");
  return t;
}

}  // namespace anvil
