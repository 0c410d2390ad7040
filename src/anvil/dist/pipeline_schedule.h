// Pipeline schedules as plain programs: for each pipeline rank, the ordered
// list of actions it runs in one step — F (forward of a micro-batch on a
// stage) and B (its backward) — so a schedule reads micro-batch by
// micro-batch and the executor (dist/pipeline.h) is one loop over actions.
// A program is checked before the first step: every (stage, micro-batch)
// gets one F and one B on the rank that holds the stage, and a simulation in
// which a rank blocks only to receive (sends never block) runs it to the end.
//
// One stage per rank for now, stage s on pp rank s:
//   GPipe   every forward, then every backward: m micro-batches in flight
//   1F1B    rank r runs P − 1 − r warm-up forwards, then alternates one
//           forward and one backward, then drains: at most P − r micro-batches
//           in flight on rank r, one on the last stage (PipeDream-Flush)
#pragma once
#include <string>
#include <vector>

namespace anvil {

enum class PipeOp : char { forward = 'F', backward = 'B' };

struct PipeAction {
  PipeOp op;
  int stage;
  int micro_batch;
  bool operator==(const PipeAction&) const = default;
};

// program[r]: pp rank r's actions in order.
using PipeProgram = std::vector<std::vector<PipeAction>>;

// The schedules by torchtitan's names (parallelism.pipeline_parallel_schedule):
// "GPipe" and "1F1B", over `stages` stages (one per rank) and m micro-batches.
// Throws anvil::Error for an unknown name, or too few micro-batches for the
// schedule (1F1B needs at least one per stage), saying how many it needs.
PipeProgram make_pipeline_program(const std::string& schedule, int stages, int micro_batches);

// Throws anvil::Error naming the first wrong action: a stage on the wrong
// rank, a micro-batch missing or run twice, a backward before its forward,
// or a deadlock (each blocked rank's next action).
void check_pipeline_program(const PipeProgram& program, int stages, int micro_batches);

// "1F0" style, for messages and traces: op, stage, micro-batch.
std::string action_name(const PipeAction& a);

}  // namespace anvil
