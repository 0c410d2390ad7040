#include "anvil/dist/pipeline_schedule.h"

#include <algorithm>

#include "anvil/core/error.h"

namespace anvil {

std::string action_name(const PipeAction& a) {
  return std::to_string(a.stage) + static_cast<char>(a.op) + std::to_string(a.micro_batch);
}

namespace {

PipeProgram gpipe(int P, int m) {
  PipeProgram program(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r) {
    for (int i = 0; i < m; ++i) program[static_cast<size_t>(r)].push_back({PipeOp::forward, r, i});
    for (int i = 0; i < m; ++i) program[static_cast<size_t>(r)].push_back({PipeOp::backward, r, i});
  }
  return program;
}

PipeProgram one_f_one_b(int P, int m) {
  PipeProgram program(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r) {
    std::vector<PipeAction>& a = program[static_cast<size_t>(r)];
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

}  // namespace

PipeProgram make_pipeline_program(const std::string& schedule, int stages, int micro_batches) {
  ANVIL_CHECK(stages >= 1 && micro_batches >= 1, "a pipeline needs at least one stage and one micro-batch");
  PipeProgram program;
  if (schedule == "GPipe") {
    program = gpipe(stages, micro_batches);
  } else if (schedule == "1F1B") {
    ANVIL_CHECK(micro_batches >= stages, "the 1F1B schedule over ", stages, " stages needs at least ", stages,
                " micro-batches per step, one per stage, but this step has ", micro_batches,
                "; raise training.local_batch_size or lower parallelism.pipeline_parallel_microbatch_size "
                "(micro-batches = local_batch_size / pipeline_parallel_microbatch_size), or use GPipe");
    program = one_f_one_b(stages, micro_batches);
  } else {
    throw Error(detail::concat("parallelism.pipeline_parallel_schedule = \"", schedule,
                               "\" is not one of: GPipe, 1F1B"));
  }
  check_pipeline_program(program, stages, micro_batches);
  return program;
}

void check_pipeline_program(const PipeProgram& program, int stages, int micro_batches) {
  const int P = static_cast<int>(program.size());
  ANVIL_CHECK(P == stages, "the schedule has ", P, " ranks' rows for ", stages, " stages (one stage per rank)");
  // Each (stage, micro-batch)'s forward and backward, on the stage's rank, once.
  std::vector<int> seen(static_cast<size_t>(2 * stages * micro_batches), 0);
  auto slot = [&](const PipeAction& a) {
    return static_cast<size_t>((a.op == PipeOp::forward ? 0 : 1) * stages * micro_batches + a.stage * micro_batches +
                               a.micro_batch);
  };
  for (int r = 0; r < P; ++r)
    for (const PipeAction& a : program[static_cast<size_t>(r)]) {
      ANVIL_CHECK(a.stage == r, "rank ", r, " runs ", action_name(a), ", but stage ", a.stage, " is on rank ",
                  a.stage % P);
      ANVIL_CHECK(a.micro_batch >= 0 && a.micro_batch < micro_batches, "rank ", r, " runs ", action_name(a),
                  ": the step has micro-batches 0 to ", micro_batches - 1);
      ANVIL_CHECK(++seen[slot(a)] == 1, "rank ", r, " runs ", action_name(a), " twice");
    }
  for (int s = 0; s < stages; ++s)
    for (int i = 0; i < micro_batches; ++i)
      for (PipeOp op : {PipeOp::forward, PipeOp::backward})
        ANVIL_CHECK(seen[slot({op, s, i})] == 1, "no rank runs ", action_name({op, s, i}));

  // Run it: an action is ready when what it receives has been sent (and, for
  // a backward, its own forward has run); sends never block.
  std::vector<int> done(seen.size(), 0);
  std::vector<size_t> next(static_cast<size_t>(P), 0);
  auto ready = [&](const PipeAction& a) {
    if (a.op == PipeOp::forward) return a.stage == 0 || done[slot({PipeOp::forward, a.stage - 1, a.micro_batch})];
    return done[slot({PipeOp::forward, a.stage, a.micro_batch})] &&
           (a.stage == stages - 1 || done[slot({PipeOp::backward, a.stage + 1, a.micro_batch})]);
  };
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < P; ++r) {
      const std::vector<PipeAction>& row = program[static_cast<size_t>(r)];
      size_t& n = next[static_cast<size_t>(r)];
      while (n < row.size() && ready(row[n])) {
        done[slot(row[n])] = 1;
        ++n;
        progress = true;
      }
    }
  }
  std::string blocked;
  for (int r = 0; r < P; ++r)
    if (next[static_cast<size_t>(r)] < program[static_cast<size_t>(r)].size())
      blocked += detail::concat(blocked.empty() ? "" : ", ", "rank ", r, " at ",
                                action_name(program[static_cast<size_t>(r)][next[static_cast<size_t>(r)]]));
  ANVIL_CHECK(blocked.empty(), "the pipeline schedule deadlocks: ", blocked,
              " wait for what no rank will send (a backward waits for the next stage's backward of its "
              "micro-batch, a forward for the previous stage's forward)");
}

}  // namespace anvil
