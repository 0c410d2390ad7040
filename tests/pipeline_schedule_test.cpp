// Pipeline schedules as programs: placements, each schedule's order, what it
// keeps in flight, its simulated bubble beside the closed forms, the CSV
// format, and the checks that refuse a bad schedule naming the action or
// cell (distributed/pipeline_schedule.h).
#include "anvil/pipeline/schedule.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "anvil/core/error.h"
#include "test_util.h"

using namespace anvil;
using anvil::testing::error_of;

namespace {

const char* const kAll[] = {"GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble"};

std::string row_of(const std::vector<PipeAction>& row) {
  std::string out;
  for (const PipeAction& a : row) {
    if (!out.empty()) out += ' ';
    out += action_name(a);
  }
  return out;
}

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }


PipeSchedule schedule(const char* name, int P, int V, int m) { return make_pipeline_schedule(name, P, V, m); }

// The schedules that run any number (two or more) of stages per rank.
bool looped(const std::string& name) {
  return name == "Interleaved1F1B" || name == "LoopedBFS" || name == "InterleavedZeroBubble";
}

// The CSV of a schedule with one cell replaced ("row,column" 1-based).
std::string csv_with(const PipeSchedule& s, int row, int column, const std::string& cell) {
  PipeProgram p = s.program;
  std::string out;
  for (size_t r = 0; r < p.size(); ++r) {
    for (size_t k = 0; k < p[r].size(); ++k) {
      if (k) out += ',';
      out += static_cast<int>(r) + 1 == row && static_cast<int>(k) + 1 == column ? cell : action_name(p[r][k]);
    }
    out += '\n';
  }
  return out;
}

}  // namespace

TEST(PipelineSchedule, Placements) {
  const PipePlacement looped = looped_placement(2, 3);
  EXPECT_EQ(looped.ranks, 2);
  EXPECT_EQ(looped.rank_of_stage, (std::vector<int>{0, 1, 0, 1, 0, 1}));
  EXPECT_EQ(looped.stages_of(1), (std::vector<int>{1, 3, 5}));
  EXPECT_EQ(looped_placement(4, 1).rank_of_stage, (std::vector<int>{0, 1, 2, 3}));
  // The V: down the ranks and back, so the first and last stage share rank 0.
  const PipePlacement v = v_placement(3);
  EXPECT_EQ(v.rank_of_stage, (std::vector<int>{0, 1, 2, 2, 1, 0}));
  EXPECT_EQ(v.stages_of(0), (std::vector<int>{0, 5}));
  EXPECT_EQ(v.stages_of(2), (std::vector<int>{2, 3}));
}

TEST(PipelineSchedule, StagesPerRankFollowTheSchedule) {
  EXPECT_EQ(schedule_stages_per_rank("GPipe", 0), 1);
  EXPECT_EQ(schedule_stages_per_rank("1F1B", 1), 1);
  EXPECT_EQ(schedule_stages_per_rank("ZBVZeroBubble", 0), 2);
  EXPECT_EQ(schedule_stages_per_rank("ZBVZeroBubble", 2), 2);
  EXPECT_EQ(schedule_stages_per_rank("Interleaved1F1B", 0), 2);
  EXPECT_EQ(schedule_stages_per_rank("LoopedBFS", 3), 3);
  EXPECT_EQ(schedule_stages_per_rank("InterleavedZeroBubble", -1), 2);
  std::string e = error_of([] { schedule_stages_per_rank("1F1B", 2); });
  EXPECT_TRUE(has(e, "one stage per rank") && has(e, "Interleaved1F1B")) << e;
  e = error_of([] { schedule_stages_per_rank("ZBVZeroBubble", 3); });
  EXPECT_TRUE(has(e, "two stages per rank")) << e;
  e = error_of([] { schedule_stages_per_rank("Interleaved1F1B", 1); });
  EXPECT_TRUE(has(e, "use 1F1B")) << e;
  e = error_of([] { schedule_stages_per_rank("Zigzag", 0); });
  for (const char* name : kAll) EXPECT_TRUE(has(e, name)) << e;
  EXPECT_TRUE(has(e, "\"Zigzag\" is not one of") && has(e, "parallelism.pipeline_parallel_schedule_csv")) << e;
  EXPECT_TRUE(has(error_of([] { make_pipeline_schedule("Zigzag", 2, 1, 2); }), "is not one of"));
}

TEST(PipelineSchedule, OneFOneBWarmsUpThenAlternates) {
  const PipeProgram p = schedule("1F1B", 2, 1, 4).program;
  EXPECT_EQ(row_of(p[0]), "0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3");
  EXPECT_EQ(row_of(p[1]), "1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3");
}

TEST(PipelineSchedule, GPipeRunsEveryForwardThenEveryBackward) {
  const PipeProgram p = schedule("GPipe", 2, 1, 3).program;
  EXPECT_EQ(row_of(p[0]), "0F0 0F1 0F2 0B0 0B1 0B2");
  EXPECT_EQ(row_of(p[1]), "1F0 1F1 1F2 1B0 1B1 1B2");
}

// Worked by hand from Megatron's rule: forwards in rounds of P micro-batches
// through chunk 0 then chunk 1 (stage chunk·P + r), backwards the same rounds
// with the chunks reversed; rank 0 warms up with 2·(P−1) + (V−1)·P = 4
// forwards, rank 1 with 2.
TEST(PipelineSchedule, InterleavedOneFOneBRunsRoundsThroughEachChunk) {
  const PipeSchedule s = schedule("Interleaved1F1B", 2, 2, 4);
  EXPECT_EQ(s.placement.rank_of_stage, (std::vector<int>{0, 1, 0, 1}));
  EXPECT_EQ(row_of(s.program[0]), "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3");
  EXPECT_EQ(row_of(s.program[1]), "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3");
}

// The same order with B split; rank 1 keeps one W pending in the steady
// state, runs one per I in the cooldown and its last one at the end; rank 0
// defers none.
TEST(PipelineSchedule, InterleavedZeroBubbleDefersWeightGradients) {
  const PipeSchedule s = schedule("InterleavedZeroBubble", 2, 2, 4);
  EXPECT_EQ(row_of(s.program[0]),
            "0F0 0F1 2F0 2F1 0F2 2I0 2W0 0F3 2I1 2W1 2F2 0I0 0W0 2F3 0I1 0W1 2I2 2W2 2I3 2W3 0I2 0W2 0I3 0W3");
  EXPECT_EQ(row_of(s.program[1]),
            "1F0 1F1 3F0 3I0 3F1 3I1 3W0 1F2 1I0 3W1 1F3 1I1 1W0 3F2 3I2 1W1 3F3 3I3 3W2 1I2 3W3 1I3 1W2 1W3");
}

TEST(PipelineSchedule, LoopedBfsRunsEachStageInTurn) {
  const PipeProgram p = schedule("LoopedBFS", 2, 2, 2).program;
  EXPECT_EQ(row_of(p[0]), "0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1");
  EXPECT_EQ(row_of(p[1]), "1F0 1F1 3F0 3F1 3B0 3B1 1B0 1B1");
  // Any number of micro-batches, even fewer than the ranks.
  EXPECT_NO_THROW(schedule("LoopedBFS", 4, 2, 1));
}

TEST(PipelineSchedule, ZbvRunsTheVWithSplitBackwards) {
  const PipeSchedule s = schedule("ZBVZeroBubble", 2, 0, 2);
  EXPECT_EQ(s.placement.rank_of_stage, (std::vector<int>{0, 1, 1, 0}));
  for (const std::vector<PipeAction>& row : s.program) {
    EXPECT_EQ(row.size(), 12u) << "2 stages × 2 micro-batches × F, I, W";
    for (const PipeAction& a : row) EXPECT_NE(a.op, PipeOp::backward) << row_of(row);
  }
}

// Every schedule, every shape the issue lists: the constructor checks, and
// the check passes again from outside; every rank holds its share of stages.
// What a row holds at once: a micro-batch-stage from its F to its B, or to
// its W when split (its I frees nothing the W needs).
TEST(PipelineSchedule, InFlightCountsFromForwardToTheEndOfTheBackward) {
  using Op = PipeOp;
  EXPECT_EQ(max_in_flight({{Op::forward, 0, 0}, {Op::forward, 0, 1}, {Op::backward, 0, 0}, {Op::backward, 0, 1}}), 2);
  EXPECT_EQ(max_in_flight({{Op::forward, 0, 0}, {Op::backward_input, 0, 0}, {Op::forward, 0, 1},
                           {Op::backward_weight, 0, 0}, {Op::backward_input, 0, 1}, {Op::backward_weight, 0, 1}}),
            2);
  EXPECT_EQ(max_in_flight({{Op::forward, 0, 0}, {Op::backward, 0, 0}, {Op::forward, 0, 1}, {Op::backward, 0, 1}}), 1);
  // Per stage over the program: 1F1B on 2 ranks holds 2 on stage 0, 1 on stage 1.
  EXPECT_EQ(stage_in_flight(schedule("1F1B", 2, 1, 4)), (std::vector<int>{2, 1}));
}

TEST(PipelineSchedule, EveryScheduleIsValid) {
  for (const char* name : kAll)
    for (int P : {2, 4})
      for (int m : {4, 8, 16})
        for (int V : {1, 2, 3}) {
          if (looped(name) ? V == 1 : V != schedule_stages_per_rank(name, 0)) continue;
          SCOPED_TRACE(::testing::Message() << name << " P " << P << " V " << V << " m " << m);
          const PipeSchedule s = schedule(name, P, V, m);
          EXPECT_EQ(s.placement.stages(), P * V);
          EXPECT_EQ(s.program.size(), static_cast<size_t>(P));
          for (int r = 0; r < P; ++r) EXPECT_EQ(s.placement.stages_of(r).size(), static_cast<size_t>(V));
          EXPECT_NO_THROW(check_pipeline_schedule(s, m));
          // The same program under fewer micro-batches than it names is refused.
          EXPECT_TRUE(has(error_of([&] { check_pipeline_schedule(s, m - 1); }), "micro-batches 0 to")) << name;
        }
}

// What bounds memory: under 1F1B rank r holds at most P − r micro-batches
// whatever their number (the last stage one), under GPipe all of them;
// interleaved rank r holds its warm-up plus one micro-batch-stage, capped by
// all V·m; the zero-bubble interleaving r more (its deferred W's); LoopedBFS
// all V·m; ZB-V at most 2P micro-batch-stages (P micro-batches' worth).
TEST(PipelineSchedule, InFlightMicroBatchesFollowTheSchedule) {
  for (int P : {2, 4})
    for (int m : {4, 8, 16}) {
      const PipeProgram one_f_one_b = schedule("1F1B", P, 1, m).program, gpipe = schedule("GPipe", P, 1, m).program;
      const PipeProgram zbv = schedule("ZBVZeroBubble", P, 2, m).program;
      for (int r = 0; r < P; ++r) {
        SCOPED_TRACE(::testing::Message() << "P " << P << " m " << m << " rank " << r);
        const size_t R = static_cast<size_t>(r);
        EXPECT_EQ(max_in_flight(one_f_one_b[R]), P - r);
        EXPECT_EQ(max_in_flight(gpipe[R]), m);
        EXPECT_LE(max_in_flight(zbv[R]), 2 * P);
        for (int V : {2, 3}) {
          const int warmup = 2 * (P - r - 1) + (V - 1) * P;
          EXPECT_EQ(max_in_flight(schedule("Interleaved1F1B", P, V, m).program[R]), std::min(warmup + 1, V * m));
          EXPECT_EQ(max_in_flight(schedule("InterleavedZeroBubble", P, V, m).program[R]),
                    std::min(warmup + 1 + r, V * m));
          EXPECT_EQ(max_in_flight(schedule("LoopedBFS", P, V, m).program[R]), V * m);
        }
      }
    }
}

double worst_bubble(const PipeSchedule& s, const PipeCosts& costs) {
  const PipeTimeline t = simulate_pipeline_schedule(s, costs);
  double worst = 0;
  for (int r = 0; r < static_cast<int>(t.busy.size()); ++r) worst = std::max(worst, t.bubble_fraction(r));
  return worst;
}

// Unit costs, F = 1 and B = I + W = 2 (a backward costs about two forwards):
// the simulated bubble of every rank is the closed form exactly. The
// zero-bubble schedules, F = I = W = 1, come in below 1F1B's; the printed
// table is what the report quotes.
TEST(PipelineSchedule, SimulatedBubblesMatchTheClosedForms) {
  const PipeCosts unit{1, 1, 1};
  for (int P : {2, 4})
    for (int m : {4, 8, 16}) {
      SCOPED_TRACE(::testing::Message() << "P " << P << " m " << m);
      for (const char* name : {"GPipe", "1F1B"}) {
        const PipeTimeline t = simulate_pipeline_schedule(schedule(name, P, 1, m), unit);
        EXPECT_DOUBLE_EQ(t.makespan, 3.0 * (m + P - 1)) << name;
        for (int r = 0; r < P; ++r) {
          EXPECT_EQ(t.busy[static_cast<size_t>(r)], 3.0 * m);
          EXPECT_NEAR(t.bubble_fraction(r), (P - 1.0) / (m + P - 1), 1e-12) << name << " rank " << r;
        }
      }
      const double one_f_one_b = worst_bubble(schedule("1F1B", P, 1, m), unit);
      for (int V : {2, 3}) {
        const PipeTimeline t = simulate_pipeline_schedule(schedule("Interleaved1F1B", P, V, m), unit);
        const PipeTimeline zb = simulate_pipeline_schedule(schedule("InterleavedZeroBubble", P, V, m), unit);
        for (int r = 0; r < P; ++r) {
          EXPECT_NEAR(t.bubble_fraction(r), (P - 1.0) / (V * m + P - 1), 1e-12) << "Interleaved1F1B V " << V;
          // ZB-H1: the bubble time falls from 3·(P−1) to P−1 (header of the .cpp).
          EXPECT_NEAR(zb.bubble_fraction(r), (P - 1.0) / (3.0 * V * m + P - 1), 1e-12) << "ZB V " << V;
          EXPECT_LT(zb.bubble_fraction(r), t.bubble_fraction(r));
        }
        std::printf(
            "P %d m %2d V %d: 1F1B %.4f (closed %.4f)  Interleaved1F1B %.4f (closed %.4f)  "
            "InterleavedZeroBubble %.4f  LoopedBFS %.4f\n",
            P, m, V, one_f_one_b, (P - 1.0) / (m + P - 1), worst_bubble(schedule("Interleaved1F1B", P, V, m), unit),
            (P - 1.0) / (V * m + P - 1), worst_bubble(schedule("InterleavedZeroBubble", P, V, m), unit),
            worst_bubble(schedule("LoopedBFS", P, V, m), unit));
      }
      const double zbv = worst_bubble(schedule("ZBVZeroBubble", P, 2, m), unit);
      EXPECT_LT(zbv, one_f_one_b);
      std::printf("P %d m %2d: ZBVZeroBubble %.4f  GPipe %.4f\n", P, m, zbv,
                  worst_bubble(schedule("GPipe", P, 1, m), unit));
    }
}

TEST(PipelineSchedule, SimulatorCostsAndWaits) {
  // Two ranks, one micro-batch, F = 2, I = 3, W = 5: rank 1 waits 2 for 1F0
  // and runs 1F0, 1B0 (8); rank 0 waits for 1B0 (at 2 + 2 + 8 = 12), then 0B0.
  const PipeSchedule s = schedule("GPipe", 2, 1, 1);
  const PipeTimeline t = simulate_pipeline_schedule(s, {2, 3, 5});
  EXPECT_DOUBLE_EQ(t.makespan, 12 + 8);
  EXPECT_DOUBLE_EQ(t.busy[0], 10);
  EXPECT_DOUBLE_EQ(t.busy[1], 10);
  EXPECT_DOUBLE_EQ(t.bubble_fraction(1), 0.5);
  // The same with I and W split and W's run last: rank 0's I starts when
  // rank 1's I ends (2 + 2 + 3 = 7), so the step ends at 7 + 3 + 5 = 15.
  PipeSchedule zb = s;
  for (std::vector<PipeAction>& row : zb.program) {
    row.back().op = PipeOp::backward_input;
    row.push_back({PipeOp::backward_weight, row.back().stage, 0});
  }
  EXPECT_DOUBLE_EQ(simulate_pipeline_schedule(zb, {2, 3, 5}).makespan, 15);
}

TEST(PipelineSchedule, TooFewMicroBatchesSaysHowMany) {
  std::string e = error_of([] { make_pipeline_schedule("1F1B", 4, 1, 2); });
  EXPECT_TRUE(has(e, "needs at least 4 micro-batches per step") && has(e, "this step has 2")) << e;
  EXPECT_TRUE(has(e, "training.local_batch_size") && has(e, "pipeline_parallel_microbatch_size")) << e;
  for (const char* name : {"Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"}) {
    e = error_of([&] { make_pipeline_schedule(name, 4, 2, 3); });
    EXPECT_TRUE(has(e, "needs at least 4 micro-batches per step") && has(e, "this step has 3")) << name << ": " << e;
  }
  for (const char* name : {"Interleaved1F1B", "InterleavedZeroBubble"}) {
    e = error_of([&] { make_pipeline_schedule(name, 4, 2, 6); });
    EXPECT_TRUE(has(e, "multiple of 4 micro-batches per step (4, 8, 12, ...)") && has(e, "this step has 6") &&
                has(e, "training.local_batch_size"))
        << name << ": " << e;
  }
  EXPECT_NO_THROW(make_pipeline_schedule("ZBVZeroBubble", 4, 2, 6));
  EXPECT_NO_THROW(make_pipeline_schedule("GPipe", 4, 1, 1));
}

TEST(PipelineSchedule, ABadProgramIsRefusedNamingTheAction) {
  PipeSchedule s = schedule("1F1B", 2, 1, 2);
  // The last stage's backward of micro-batch 0 before its forward: a deadlock.
  std::swap(s.program[1][0], s.program[1][1]);
  std::string e = error_of([&] { check_pipeline_schedule(s, 2); });
  EXPECT_TRUE(has(e,
                  "deadlocks: rank 0 runs 0B0 (action 2 of its row) waits for 1B0, which rank 1 runs later "
                  "(action 0 of its row); rank 1 runs 1B0 (action 0 of its row) waits for 1F0, which rank 1 "
                  "runs later (action 1 of its row)"))
      << e;
  // B1 before B0 on every stage is valid.
  s = schedule("GPipe", 2, 1, 2);
  std::swap(s.program[0][2], s.program[0][3]);
  std::swap(s.program[1][2], s.program[1][3]);
  EXPECT_EQ(error_of([&] { check_pipeline_schedule(s, 2); }), "");
  s = schedule("GPipe", 2, 1, 2);
  s.program[1].pop_back();
  EXPECT_TRUE(has(error_of([&] { check_pipeline_schedule(s, 2); }), "no rank runs 1B1"));
  s = schedule("GPipe", 2, 1, 2);
  s.program[0][0].stage = 1;
  e = error_of([&] { check_pipeline_schedule(s, 2); });
  EXPECT_TRUE(has(e, "rank 0 runs 1F0 (action 0 of its row), but stage 1 is on rank 1")) << e;
  s = schedule("GPipe", 2, 1, 2);
  s.program[0][3] = s.program[0][2];
  e = error_of([&] { check_pipeline_schedule(s, 2); });
  EXPECT_TRUE(has(e, "rank 0 runs 0B0 (action 3 of its row) a second time; it first ran at action 2 of its row")) << e;
  s = schedule("GPipe", 2, 1, 2);
  s.placement = looped_placement(3, 1);
  EXPECT_TRUE(has(error_of([&] { check_pipeline_schedule(s, 2); }), "2 rows of actions for 3 pipeline ranks"));
}

TEST(PipelineSchedule, SplitBackwardsAreChecked) {
  const PipeSchedule good = schedule("InterleavedZeroBubble", 2, 2, 2);
  // A B beside the I and W of the same micro-batch-stage.
  PipeSchedule s = good;
  s.program[0].push_back({PipeOp::backward, 0, 0});
  std::string e = error_of([&] { check_pipeline_schedule(s, 2); });
  EXPECT_TRUE(has(e, "rank 0 runs 0B0") && has(e, ", and rank 0 runs 0I0 (action ") && has(e, "not both")) << e;
  // A W with no I, an I with no W.
  s = good;
  std::erase(s.program[1], PipeAction{PipeOp::backward_input, 1, 1});
  e = error_of([&] { check_pipeline_schedule(s, 2); });
  EXPECT_TRUE(has(e, "no rank runs 1I1, which rank 1's 1W1 (action ")) << e;
  s = good;
  std::erase(s.program[1], PipeAction{PipeOp::backward_weight, 3, 0});
  e = error_of([&] { check_pipeline_schedule(s, 2); });
  EXPECT_TRUE(has(e, "no rank runs 3W0 after rank 1's 3I0 (action ")) << e;
  // A W before its I.
  s = good;
  std::vector<PipeAction>& row = s.program[0];
  const auto i = std::find(row.begin(), row.end(), PipeAction{PipeOp::backward_input, 0, 1});
  const auto w = std::find(row.begin(), row.end(), PipeAction{PipeOp::backward_weight, 0, 1});
  std::iter_swap(i, w);
  e = error_of([&] { check_pipeline_schedule(s, 2); });
  EXPECT_TRUE(has(e, "rank 0 runs 0W1") && has(e, "before its 0I1") && has(e, "a W uses what its I computed")) << e;
}

TEST(PipelineScheduleCsv, EveryScheduleRoundTrips) {
  for (const char* name : kAll)
    for (int P : {2, 4}) {
      const int V = schedule_stages_per_rank(name, looped(name) ? 3 : 0);
      const PipeSchedule s = schedule(name, P, V, 8);
      const std::string csv = format_pipeline_csv(s.program);
      const PipeSchedule back = parse_pipeline_schedule_csv(csv, "s.csv", P, 8);
      EXPECT_EQ(back.program, s.program) << name << " P " << P;
      EXPECT_EQ(back.placement.rank_of_stage, s.placement.rank_of_stage) << name << " P " << P;
      EXPECT_EQ(back.name, "s.csv");
      EXPECT_EQ(format_pipeline_csv(back.program), csv);
    }
  EXPECT_EQ(format_pipeline_csv(schedule("1F1B", 2, 1, 2).program), "0F0,0F1,0B0,0B1\n1F0,1B0,1F1,1B1\n");
}

TEST(PipelineScheduleCsv, SpacesBlankCellsAndTheLastNewlineAreIgnored) {
  const PipeSchedule s = parse_pipeline_schedule_csv(" 0F0 , ,0F1,0B0,0B1,\n1F0,1B0,,1F1,1B1", "s.csv", 2, 2);
  EXPECT_EQ(s.program, schedule("1F1B", 2, 1, 2).program);
}

TEST(PipelineScheduleCsv, BadFilesAreRefusedNamingTheCell) {
  const PipeSchedule zb = schedule("InterleavedZeroBubble", 2, 2, 2);
  // torchtitan's communication actions are not cells Anvil runs.
  std::string e = error_of([&] { parse_pipeline_schedule_csv(csv_with(zb, 2, 3, "0SEND_F1"), "s.csv", 2, 2); });
  EXPECT_TRUE(has(e, "s.csv row 2, column 3 (\"0SEND_F1\") is not an action") &&
              has(e, "<stage><F|B|I|W><micro-batch>"))
      << e;
  for (const char* bad : {"F1", "0X1", "0F", "0F1x", "-1F0", "0 F1", "0UNSHARD"})
    EXPECT_TRUE(
        has(error_of([&] { parse_pipeline_schedule_csv(csv_with(zb, 1, 1, bad), "s.csv", 2, 2); }), "is not an action"))
        << bad;
  // Stage 1 (rank 1's) put on rank 0.
  e = error_of([&] { parse_pipeline_schedule_csv(csv_with(zb, 1, 4, "1F0"), "s.csv", 2, 2); });
  EXPECT_TRUE(has(e,
                  "s.csv row 2, column 1 (\"1F0\") runs stage 1 on rank 1, but row 1 (rank 0) runs it too, "
                  "first at column 4"))
      << e;
  // A missing W: rank 1's 1W1 blanked.
  const int w_column = static_cast<int>(std::find(zb.program[1].begin(), zb.program[1].end(),
                                                  PipeAction{PipeOp::backward_weight, 1, 1}) -
                                        zb.program[1].begin()) +
                       1;
  e = error_of([&] { parse_pipeline_schedule_csv(csv_with(zb, 2, w_column, ""), "s.csv", 2, 2); });
  EXPECT_TRUE(has(e, "no rank runs 1W1 after rank 1's 1I1 (s.csv row 2, column ")) << e;
  // A W before its I: swap rank 0's 0I1 and 0W1 in the text.
  const std::vector<PipeAction>& row0 = zb.program[0];
  const int i_col =
      static_cast<int>(std::find(row0.begin(), row0.end(), PipeAction{PipeOp::backward_input, 0, 1}) - row0.begin()) +
      1;
  const int w_col =
      static_cast<int>(std::find(row0.begin(), row0.end(), PipeAction{PipeOp::backward_weight, 0, 1}) - row0.begin()) +
      1;
  PipeSchedule swapped = zb;
  std::swap(swapped.program[0][static_cast<size_t>(i_col - 1)], swapped.program[0][static_cast<size_t>(w_col - 1)]);
  e = error_of([&] { parse_pipeline_schedule_csv(format_pipeline_csv(swapped.program), "s.csv", 2, 2); });
  EXPECT_TRUE(has(e, "rank 0 runs 0W1 (s.csv row 1, column " + std::to_string(i_col) +
                         ") before its 0I1 (s.csv row 1, column " + std::to_string(w_col) + ")"))
      << e;
  // A deadlock: rank 1 runs its backward before its forward; blank cells
  // shift the columns, and the message counts them.
  e = error_of([] { parse_pipeline_schedule_csv("0F0,0B0\n,1B0,1F0\n", "s.csv", 2, 1); });
  EXPECT_TRUE(has(e, "s.csv deadlocks: rank 0 runs 0B0 (s.csv row 1, column 2) waits for 1B0") &&
              has(e,
                  "rank 1 runs 1B0 (s.csv row 2, column 2) waits for 1F0, which rank 1 runs later "
                  "(s.csv row 2, column 3)"))
      << e;
  // A forward waiting for the previous stage's: rank 0 sends 0F1 only after
  // 0B0, which needs 1B0, which rank 1 runs after 1F1.
  e = error_of([] { parse_pipeline_schedule_csv("0F0,0B0,0F1,0B1\n1F0,1F1,1B0,1B1\n", "s.csv", 2, 2); });
  EXPECT_TRUE(has(e,
                  "rank 1 runs 1F1 (s.csv row 2, column 2) waits for 0F1, which rank 0 runs later (s.csv row 1, "
                  "column 3)"))
      << e;
  // Files whose shape is wrong, each over 2 ranks and 1 micro-batch.
  struct Refusal {
    const char* text;
    const char* message;
  };
  const Refusal refusals[] = {
      // Rows: one per rank.
      {"0F0,0B0\n", "s.csv has 1 rows, but the pipeline has 2 ranks"},
      {"0F0,0B0\n1F0,1B0\n2F0,2B0\n", "s.csv has 3 rows, but the pipeline has 2 ranks"},
      // Stages without gaps, the same number on every rank.
      {"0F0,0B0\n2F0,2B0\n", "no row runs stage 1"},
      {"0F0,2F0,2B0,0B0\n1F0,1B0\n", "s.csv runs 3 stages, which 2 ranks cannot share evenly"},
      {"0F0,2F0,3F0,3B0,2B0,0B0\n1F0,1B0\n",
       "s.csv row 1 (rank 0) runs 3 stages, but 4 stages over 2 ranks means 2 on every rank"},
      // Micro-batches beyond the step's.
      {"0F0,0B0\n1F0,1B0,1F1\n", "rank 1 runs 1F1 (s.csv row 2, column 3), but the step has micro-batches 0 to 0"},
  };
  for (const Refusal& r : refusals) {
    e = error_of([&] { parse_pipeline_schedule_csv(r.text, "s.csv", 2, 1); });
    EXPECT_TRUE(has(e, r.message)) << r.text << " gave: " << e;
  }
}

TEST(PipelineScheduleCsv, ReadsAFileAndNamesAMissingOne) {
  const std::string path = ::testing::TempDir() + "pipeline_schedule_test.csv";
  const PipeSchedule s = schedule("ZBVZeroBubble", 2, 2, 4);
  {
    std::FILE* f = std::fopen(path.c_str(), "wb");
    ASSERT_NE(f, nullptr);
    const std::string csv = format_pipeline_csv(s.program);
    std::fwrite(csv.data(), 1, csv.size(), f);
    std::fclose(f);
  }
  const PipeSchedule back = read_pipeline_schedule_csv(path, 2, 4);
  EXPECT_EQ(back.program, s.program);
  EXPECT_EQ(back.placement.rank_of_stage, v_placement(2).rank_of_stage);
  std::remove(path.c_str());
  const std::string e = error_of([&] { read_pipeline_schedule_csv(path, 2, 4); });
  EXPECT_TRUE(has(e, "cannot open the pipeline schedule " + path) &&
              has(e, "parallelism.pipeline_parallel_schedule_csv"))
      << e;
}

// ZB-V planned with the stages' costs: with costs in the proportions measured
// on llama3/25M at P = 2 (docs/pipeline.md: the outer stages hold one block,
// the inner two, and the last stage's I carries the fused head, about 6 times
// a block's pass), the program planned for those costs finishes sooner, run
// with those costs, than the one planned for equal costs, and still holds at
// most 2P micro-batch-stages per rank.
TEST(PipelineSchedule, ZbvPlannedWithTheStagesCostsBeatsTheEqualCostPlan) {
  for (int P : {2, 4})
    for (int m : {4, 8, 16}) {
      std::vector<PipeCosts> costs(static_cast<size_t>(2 * P), PipeCosts{2, 2.2, 2});
      costs.front() = {1, 1.1, 1};
      costs.back() = {1, 6.2, 1};
      const PipeSchedule equal = make_pipeline_schedule("ZBVZeroBubble", P, 2, m);
      const PipeSchedule planned = make_pipeline_schedule("ZBVZeroBubble", P, 2, m, costs);
      const double t_equal = simulate_pipeline_schedule(equal, costs).makespan;
      const double t_planned = simulate_pipeline_schedule(planned, costs).makespan;
      EXPECT_LT(t_planned, t_equal) << "P " << P << " m " << m;
      std::printf("ZB-V P %d m %2d, measured-like costs: makespan %.0f planned for them, %.0f for equal costs\n",
                  P, m, t_planned, t_equal);
      for (const std::vector<PipeAction>& row : planned.program) EXPECT_LE(max_in_flight(row), 2 * P);
    }
}
