// Pipeline schedules as plain programs: for each pipeline rank, the ordered
// list of actions it runs in one step, so a schedule reads micro-batch by
// micro-batch and the executor (pipeline/executor.h) is one loop over actions:
//   F  forward of a micro-batch on a stage
//   B  its whole backward (input and weight gradients)
//   I  the input-gradient half of the backward (zero-bubble schedules): what
//      the previous stage waits for
//   W  the weight-gradient half, which nobody waits for, run later to fill
//      the bubbles
// The model is cut into S stages; a placement puts each stage on one rank:
// one stage per rank (GPipe, 1F1B), V per rank looped (stage s on rank s mod P:
// Interleaved1F1B, LoopedBFS, InterleavedZeroBubble) or in a V (ZBVZeroBubble:
// rank r holds stages r and 2P − 1 − r, so the first and last stage share
// rank 0). A schedule is checked before the first step: every (stage,
// micro-batch) gets one F and either one B or one I and one W, each on the
// rank that holds the stage, and a simulation in which a rank blocks only to
// receive (sends never block) runs it to the end.
//
//   GPipe                  every forward, then every backward: m micro-batches in flight
//   1F1B                   rank r runs P − 1 − r warm-up forwards, then alternates
//                          one forward and one backward, then drains (PipeDream-Flush)
//   Interleaved1F1B        1F1B over V stages per rank in rounds of P micro-batches
//                          (Megatron's virtual pipeline): bubble (P−1)/(V·m+P−1)
//   LoopedBFS              each of the rank's stages runs all its forwards in turn,
//                          then the backwards in reverse stage order
//   InterleavedZeroBubble  Interleaved1F1B with B split into I and W, W deferred
//                          into the cooldown's bubbles (ZB-H1)
//   ZBVZeroBubble          ZB-V: V placement, I and W split, planned by a list
//                          scheduler over the stages' estimated costs
//   a CSV file             parallelism.pipeline_parallel_schedule_csv: one row per
//                          rank, one cell per action, "<stage><op><micro-batch>"
//                          as torchtitan writes them ("0F3", "1I0", "1W0")
#pragma once
#include <string>
#include <vector>

namespace anvil {

enum class PipeOp : char { forward = 'F', backward = 'B', backward_input = 'I', backward_weight = 'W' };

struct PipeAction {
  PipeOp op;
  int stage;
  int micro_batch;
  bool operator==(const PipeAction&) const = default;
};

// program[r]: pp rank r's actions in order.
using PipeProgram = std::vector<std::vector<PipeAction>>;

// What an action needs done before it can run, besides its own rank's
// earlier actions — the one rule schedules are built, checked, simulated and
// executed by: F(s, i) needs the forward F(s − 1, i); B or I (s, i) its own
// forward F(s, i) and the backward of (s + 1, i), given as PipeOp::backward
// and met by a B or an I; W(s, i) its own I. `stages`: the pipeline's.
std::vector<PipeAction> action_inputs(const PipeAction& a, int stages);

// Which rank holds each stage.
struct PipePlacement {
  std::vector<int> rank_of_stage;  // stage s is on rank rank_of_stage[s]
  int ranks = 0;
  int stages() const { return static_cast<int>(rank_of_stage.size()); }
  int rank_of(int stage) const { return rank_of_stage[static_cast<size_t>(stage)]; }
  std::vector<int> stages_of(int rank) const;  // ascending
};
// Stage s on rank s mod ranks (one stage per rank when stages_per_rank is 1).
PipePlacement looped_placement(int ranks, int stages_per_rank);
// Two stages per rank: s on rank s for s < ranks, else on 2·ranks − 1 − s.
PipePlacement v_placement(int ranks);

struct PipeSchedule {
  std::string name;  // the schedule's name, or the CSV file's path
  PipePlacement placement;
  PipeProgram program;
};

// Stages per rank a named schedule runs: 1 for GPipe and 1F1B, 2 for
// ZBVZeroBubble, and for the looped ones `requested` (2 when it is 0 or less).
// Throws anvil::Error for an unknown name (listing the known ones) or a
// requested count the schedule cannot run.
int schedule_stages_per_rank(const std::string& name, int requested);

// What an action costs (any unit: a time, FLOPs), per stage: B costs I + W.
struct PipeCosts {
  double forward = 1, backward_input = 1, backward_weight = 1;
};

// The named schedule over `ranks` ranks with stages_per_rank stages each (as
// schedule_stages_per_rank resolves it) and m micro-batches, checked. Throws
// anvil::Error for an unknown name, or too few (or a count the schedule cannot
// divide) micro-batches, saying how many it needs and which keys set them.
// stage_costs (one per stage, or empty for equal ones): what ZBVZeroBubble's
// list scheduler plans with; the other schedules are fixed orders.
PipeSchedule make_pipeline_schedule(const std::string& name, int ranks, int stages_per_rank, int micro_batches,
                                    const std::vector<PipeCosts>& stage_costs = {});

// A schedule from CSV text (torchtitan's format: row r is rank r's actions,
// cells separated by commas, blank cells and surrounding spaces ignored),
// checked against `ranks` ranks and m micro-batches; the placement is read
// from which rank runs each stage, and every rank must hold the same number
// of stages. `where` names the source in messages ("schedule.csv"). Throws
// anvil::Error naming the row, column and cell of the first wrong one: a cell
// that does not parse, a stage run on two ranks, a missing or repeated action,
// a W before its I, a deadlock.
PipeSchedule parse_pipeline_schedule_csv(const std::string& text, const std::string& where, int ranks,
                                         int micro_batches);
PipeSchedule read_pipeline_schedule_csv(const std::string& path, int ranks, int micro_batches);
// The program as CSV, one row per rank (parse_pipeline_schedule_csv reads it back).
std::string format_pipeline_csv(const PipeProgram& program);

// Throws anvil::Error naming the first wrong action (rank, its position in the
// rank's row, and the action) as parse_pipeline_schedule_csv describes.
void check_pipeline_schedule(const PipeSchedule& schedule, int micro_batches);

// The most (stage, micro-batch) states a rank's row holds at once, each from
// its forward to the end of its backward (B, or W when split): what the
// rank's activations cost. And the same per stage, over the whole program.
int max_in_flight(const std::vector<PipeAction>& row);
std::vector<int> stage_in_flight(const PipeSchedule& schedule);

// "1F0" style, for messages, CSV and traces: stage, op, micro-batch.
std::string action_name(const PipeAction& a);

// The schedule run with fixed costs per action and instant messages: when
// each rank is busy. The bubble fraction of rank r is 1 − busy[r] / makespan.
struct PipeTimeline {
  std::vector<double> busy;  // per rank
  double makespan = 0;       // when the last rank finishes
  double bubble_fraction(int rank) const { return 1 - busy[static_cast<size_t>(rank)] / makespan; }
};
PipeTimeline simulate_pipeline_schedule(const PipeSchedule& schedule, const PipeCosts& costs = {});
// The same with each stage's own costs (one per stage).
PipeTimeline simulate_pipeline_schedule(const PipeSchedule& schedule, const std::vector<PipeCosts>& stage_costs);

}  // namespace anvil
