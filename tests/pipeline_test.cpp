// Pipeline parallelism: how the model is cut into stages and, through the
// trainer under mpirun, every pipeline row of the layout table (tests/layout_parity.h:
// every schedule at PP 2 and PP 4, a CSV schedule, PP 2 with FSDP 2, DDP 2,
// TP 2, and FSDP 2 x TP 2) against the single-process run, with the bounds and
// reasoning given there; memory against the micro-batch count; checkpoints
// across layouts; schedule files refused before the first step.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "anvil/core/error.h"
#include "anvil/estimate/pipeline_split.h"
#include "anvil/model/args.h"
#include "anvil/pipeline/executor.h"
#include "anvil/pipeline/schedule.h"
#include "layout_parity.h"

using namespace anvil;
using anvil::testing::error_of;

TEST(PipelineStages, TheEmbeddingAndTheHeadCountAsABlockEachByDefault) {
  const ModelArgs args = model_flavor("llama3", "debugmodel");  // 6 blocks
  EXPECT_EQ(pipeline_stage_modules(args, {2}, 0), std::make_pair(0, 4));  // embedding + 3 blocks
  EXPECT_EQ(pipeline_stage_modules(args, {2}, 1), std::make_pair(4, 8));  // 3 blocks + head
  EXPECT_EQ(pipeline_stage_modules(args, {3}, 0), std::make_pair(0, 3));
  EXPECT_EQ(pipeline_stage_modules(args, {3}, 1), std::make_pair(3, 6));
  EXPECT_EQ(pipeline_stage_modules(args, {3}, 2), std::make_pair(6, 8));
  const std::string e = error_of([&] { pipeline_stage_modules(args, {9}, 0); });
  EXPECT_NE(e.find("use at most 8 stages"), std::string::npos) << e;
}

TEST(PipelineStages, TheFirstAndLastStageCountsMoveBlocks) {
  const ModelArgs args = model_flavor("llama3", "debugmodel");
  // The embedding weighs nothing, the head three blocks (a large vocabulary): 9 units, 3 per stage.
  EXPECT_EQ(pipeline_stage_modules(args, {3, 0, 3}, 0), std::make_pair(0, 4));  // embedding + 3 blocks
  EXPECT_EQ(pipeline_stage_modules(args, {3, 0, 3}, 1), std::make_pair(4, 7));  // 3 blocks
  EXPECT_EQ(pipeline_stage_modules(args, {3, 0, 3}, 2), std::make_pair(7, 8));  // the head alone
  EXPECT_EQ(describe_pipeline_stages(args, {3, 0, 3}), "stage 0: embedding, blocks 0-2; stage 1: blocks 3-5; stage 2: head");
  EXPECT_EQ(describe_pipeline_stages(args, {2, 1, 3}), "stage 0: embedding, blocks 0-3; stage 1: blocks 4-5, head");
  const std::string e = error_of([&] { pipeline_stage_modules(args, {4, 1, 3}, 3); });
  EXPECT_NE(e.find("cannot hold the embedding counted as 1"), std::string::npos) << e;
}

namespace {

// Each rank's activation peak (MiB) in step 2 of a PP 2 run whose local batch
// of `micro_batches` sequences runs as micro-batches of one. boundaries: the
// stage boundaries between rank 0 and rank 1 — 1 with a stage per rank; with
// two, 3 looped (stages 0 | 1 | 2 | 3 alternate ranks) and 2 in a V (rank 0
// holds stages 0 and 3).
std::vector<double> activation_peaks(const std::string& schedule, int micro_batches, int boundaries = 1) {
  auto& r = anvil::testing::runs();
  const std::string dump = "memory_" + schedule + "_" + std::to_string(micro_batches);
  const anvil::testing::CommandOutput out =
      r.mpi(2, dump,
            anvil::testing::batch_flags(micro_batches, micro_batches) + " " + anvil::testing::kPipeline +
                "2 --parallelism.pipeline_parallel_schedule " + schedule +
                " --training.steps 2 --checkpoint.enable false");
  EXPECT_EQ(out.exit_code, 0) << out.text;
  std::ifstream in(r.dir() / dump / "metrics.jsonl");
  std::string line, last;
  while (std::getline(in, line)) last = line;
  const nlohmann::json step = nlohmann::json::parse(last);
  // What crossed the pp group on rank 0 in the step: at each of its stage
  // boundaries each micro-batch's activation (32 tokens x dim 256 x 4 bytes)
  // one way and its gradient the other, then the loss sum and token count (8
  // bytes) and the squared gradient norm (4).
  EXPECT_EQ(step.at("pp_comm_bytes_per_step").get<double>(),
            2.0 * boundaries * micro_batches * 32 * 256 * 4 + 12)
      << schedule << ", " << micro_batches << " micro-batches";
  return step.at("activation_peak_mib_by_rank").get<std::vector<double>>();
}

}  // namespace

// The schedules with two stages per rank hold a bounded number of
// micro-batches too (anvil pipeline-schedule prints the bound per rank): from
// 4 to 16 micro-batches each rank's activation peak stays within 1%. LoopedBFS
// runs every forward first and grows, as GPipe does.
TEST(PipelineMemory, InterleavedAndZeroBubbleSchedulesDoNotGrowWithMicroBatches) {
  for (const char* schedule : {"Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"}) {
    const int boundaries = std::string(schedule) == "ZBVZeroBubble" ? 2 : 3;
    const std::vector<double> m4 = activation_peaks(schedule, 4, boundaries),
                              m16 = activation_peaks(schedule, 16, boundaries);
    ASSERT_EQ(m4.size(), 2u);
    for (size_t r = 0; r < 2; ++r) {
      EXPECT_LE(m16[r], 1.01 * m4[r]) << schedule << " rank " << r << ": " << m4[r] << " MiB for 4, " << m16[r]
                                      << " for 16";
      std::printf("%-21s rank %zu: %.2f MiB (m 4), %.2f MiB (m 16)\n", schedule, r, m4[r], m16[r]);
    }
  }
  const std::vector<double> b4 = activation_peaks("LoopedBFS", 4, 3), b16 = activation_peaks("LoopedBFS", 16, 3);
  for (size_t r = 0; r < 2; ++r) EXPECT_GT(b16[r], 2 * b4[r]) << "LoopedBFS rank " << r;
}

// The automatic split prices each module and cuts where the largest stage is
// smallest: equal modules spread evenly; Llama 3's 128K-vocabulary embedding
// and head each outweigh the debug model's 4 blocks together (V·D = 32.8M
// weights against 0.8M a block), so on 2 stages the head stands alone.
TEST(PipelineStages, TheAutomaticSplitBalancesComputeAndMemory) {
  const std::vector<ModuleCost> equal(6, ModuleCost{.forward = 1, .weight_bytes = 1});
  EXPECT_EQ(balanced_pipeline_cut(equal, {1, 1, 1}), (std::vector<int>{0, 2, 4}));
  // Activations count times the micro-batches a stage holds: the first stage
  // under 1F1B holds more, so it takes fewer modules.
  const std::vector<ModuleCost> activation_heavy(6, ModuleCost{.activation_bytes = 1});
  EXPECT_EQ(balanced_pipeline_cut(activation_heavy, {2, 1}), (std::vector<int>{0, 2}));
  const ModelArgs big_vocab = model_flavor("llama3", "debugmodel_128k");  // 4 blocks
  const TrainShape shape{1, 512, DType::bf16, AcPolicy{AcMode::full, 1}};
  EXPECT_EQ(balanced_pipeline_cut(pipeline_module_costs(big_vocab, shape), {2, 1}), (std::vector<int>{0, 5}));
  const std::string e = error_of([&] { balanced_pipeline_cut(equal, std::vector<int>(7, 1)); });
  EXPECT_NE(e.find("cannot fill 7 pipeline stages"), std::string::npos) << e;
}

// Seed 000: torchtitan's last stage kept every micro-batch's output until the
// step ended, so its memory grew with the micro-batch count. Here a
// micro-batch's state lives from its forward to its backward only: under 1F1B
// each rank holds at most P − r micro-batches whatever m, so its activation
// peak is the same for 16 micro-batches as for 2 (1% allowed, measured equal);
// under GPipe every micro-batch is in flight at once, so the peak grows by one
// micro-batch's saved state per micro-batch: from 2 to 16 exactly 7 times what
// it grows from 2 to 4.
TEST(PipelineMemory, OneFOneBDoesNotGrowWithMicroBatchesAndGPipeGrowsByOneEach) {
  const std::vector<double> f2 = activation_peaks("1F1B", 2), f16 = activation_peaks("1F1B", 16);
  const std::vector<double> g2 = activation_peaks("GPipe", 2), g4 = activation_peaks("GPipe", 4),
                            g16 = activation_peaks("GPipe", 16);
  ASSERT_EQ(f2.size(), 2u);
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_LE(f16[r], 1.01 * f2[r]) << "1F1B rank " << r << ": " << f2[r] << " MiB for 2, " << f16[r] << " for 16";
    const double per_micro_batch = (g4[r] - g2[r]) / 2;
    EXPECT_GT(per_micro_batch, 0.0) << "GPipe rank " << r;
    EXPECT_NEAR(g16[r] - g2[r], 14 * per_micro_batch, 0.01 * 14 * per_micro_batch) << "GPipe rank " << r;
    std::printf("rank %zu: 1F1B %.2f MiB (m 2) %.2f MiB (m 16); GPipe %.2f, %.2f, %.2f MiB (m 2, 4, 16), %.3f MiB "
                "per micro-batch\n",
                r, f2[r], f16[r], g2[r], g4[r], g16[r], per_micro_batch);
  }
}

namespace {

// Resumes a copy of `saved`'s step-5 checkpoint under layout `target` (4
// sequences per step over its data-parallel ranks) and holds steps 6-10 to
// the uninterrupted run `whole`.
void expect_resumes_as(const std::string& saved, const std::string& target, const std::string& whole,
                       const std::string& batch) {
  namespace fs = std::filesystem;
  auto& r = anvil::testing::runs();
  const anvil::testing::Layout& t = anvil::testing::layout(target);
  SCOPED_TRACE(saved + " resumed as " + target);
  const std::string dump = saved + "_as_" + t.name;
  fs::remove_all(r.dir() / dump);
  fs::create_directories(r.dir() / dump);
  fs::copy(r.dir() / saved / "checkpoint", r.dir() / dump / "checkpoint", fs::copy_options::recursive);
  const anvil::testing::CommandOutput out = r.run(t, dump, batch + "--training.local_batch_size " + std::to_string(4 / t.dp));
  ASSERT_EQ(out.exit_code, 0) << out.text;
  EXPECT_NE(out.text.find("resumed from " + (r.dir() / dump / "checkpoint" / "step-5").string()), std::string::npos)
      << out.text;
  const auto want = r.losses(whole), got = r.losses(dump);
  ASSERT_EQ(got.size(), 5u) << out.text;
  double worst = 0;
  for (const auto& [step, loss] : got) {
    ASSERT_GE(step, 6);
    worst = std::max(worst, std::abs(loss - want.at(step)) / std::abs(want.at(step)));
  }
  EXPECT_LE(worst, 1e-5);
  std::printf("%s checkpoint resumed as %-9s: worst loss difference %.2e over steps 6-10\n", saved.c_str(),
              t.name.c_str(), worst);
}

}  // namespace

// Checkpoints hold the whole model's global tensors whatever the layout, so a
// pipeline's resumes without one and the other way round.
TEST(Pipeline, CheckpointsMoveBetweenPipelinesAndOtherLayouts) {
  auto& r = anvil::testing::runs();
  // A constant learning rate after warm-up, so stopping at step 5 changes nothing before it.
  const std::string batch = "--training.global_batch_size 4 --lr_scheduler.decay_ratio 0 ";
  const anvil::testing::CommandOutput whole = r.mpi(2, "pxl_whole", batch + "--training.local_batch_size 2");
  ASSERT_EQ(whole.exit_code, 0) << whole.text;  // FSDP 2, the default layout of 2 ranks
  const std::string stop = "--checkpoint.interval 5 --training.steps 5";
  const anvil::testing::CommandOutput from_pp =
      r.run(anvil::testing::layout("pp2_1f1b"), "pxl_pp2", batch + "--training.local_batch_size 4 " + stop);
  ASSERT_EQ(from_pp.exit_code, 0) << from_pp.text;
  const anvil::testing::CommandOutput from_fsdp = r.mpi(2, "pxl_fsdp2", batch + "--training.local_batch_size 2 " + stop);
  ASSERT_EQ(from_fsdp.exit_code, 0) << from_fsdp.text;
  for (const char* target : {"single", "fsdp2"}) expect_resumes_as("pxl_pp2", target, "pxl_whole", batch);
  for (const char* target : {"pp2_1f1b", "pp2_tp2"}) expect_resumes_as("pxl_fsdp2", target, "pxl_whole", batch);
  // Two stages per rank, in a V (rank 0 holds the first and the last) and looped.
  const anvil::testing::CommandOutput from_zbv =
      r.run(anvil::testing::layout("pp2_zbv"), "pxl_zbv", batch + "--training.local_batch_size 4 " + stop);
  ASSERT_EQ(from_zbv.exit_code, 0) << from_zbv.text;
  for (const char* target : {"single", "pp2_interleaved"}) expect_resumes_as("pxl_zbv", target, "pxl_whole", batch);
}

namespace {

double last_metric(const std::string& dump, const char* key) {
  std::ifstream in(anvil::testing::runs().dir() / dump / "metrics.jsonl");
  std::string line, last;
  while (std::getline(in, line)) last = line;
  return nlohmann::json::parse(last).at(key).get<double>();
}

}  // namespace

// FSDP under a pipeline holds each stage's gathered weights for the step by
// default: one all-gather per group per step instead of two per micro-batch,
// which the console says. The bytes FSDP moves equal the closed form either
// way (4 micro-batches per step), and "always" still reshards after each use.
TEST(Pipeline, FsdpHoldsAStageGatheredWeightsForTheStep) {
  auto& r = anvil::testing::runs();
  const anvil::testing::Layout& l = anvil::testing::layout("pp2_fsdp2");
  const std::string batch = anvil::testing::batch_flags(4, 8) + " --training.steps 2 --checkpoint.enable false ";
  const anvil::testing::CommandOutput held = r.run(l, "fsdp_held", batch);
  ASSERT_EQ(held.exit_code, 0) << held.text;
  EXPECT_NE(held.text.find("keeps each stage's gathered weights for the whole step"), std::string::npos) << held.text;
  const anvil::testing::CommandOutput always =
      r.run(l, "fsdp_always", batch + "--parallelism.fsdp_reshard_after_forward always");
  ASSERT_EQ(always.exit_code, 0) << always.text;
  EXPECT_EQ(always.text.find("keeps each stage's gathered weights"), std::string::npos);
  for (const char* dump : {"fsdp_held", "fsdp_always"})
    EXPECT_EQ(last_metric(dump, "comm_bytes_per_step"), last_metric(dump, "comm_bytes_closed_form")) << dump;
  EXPECT_LT(last_metric("fsdp_held", "comm_bytes_per_step"), last_metric("fsdp_always", "comm_bytes_per_step"));
  std::printf("FSDP bytes per step under PP 2 x FSDP 2, 4 micro-batches: %.0f held for the step, %.0f resharded\n",
              last_metric("fsdp_held", "comm_bytes_per_step"), last_metric("fsdp_always", "comm_bytes_per_step"));
}

// bf16: a pipeline runs each sequence as its own micro-batch, so beside the
// fp32 gradient sums in another order (the data-parallel layouts' reason,
// distributed_test's Bf16Layouts...), its matrix products see 1 row block of
// 32 tokens instead of 4 sequences' rows, and oneDNN may block and sum them
// differently; a bf16 activation can then round the other way. Neither
// changes what a loss averages by more than a small fraction of a bf16 ulp
// (3.9e-3), so the bound is the data-parallel layouts': 5e-4 relative per step
// over 10 steps, which a stage bug (a block run twice or skipped, a boundary
// gradient dropped) would exceed at once.
TEST(Pipeline, Bf16PipelinesStayWithinTheirToleranceOfTheSingleProcess) {
  for (const char* name : {"pp2_1f1b", "pp2_fsdp2", "pp2_zero_bubble"}) anvil::testing::expect_bf16_within(anvil::testing::layout(name), 1, 5e-4);
}

// Every rank logs the true loss (torchtitan #547 logged -1 off the last
// stage): rank 0 on the console, rank 1 in logs/rank-1.log, the same lines.
TEST(Pipeline, EveryRankLogsTheTrueLoss) {
  auto& r = anvil::testing::runs();
  const std::string dump = "rank_logs";
  std::filesystem::remove_all(r.dir() / dump);
  const anvil::testing::CommandOutput out =
      r.run(anvil::testing::layout("pp2_1f1b"), dump, anvil::testing::batch_flags(2, 2) + " --training.steps 3");
  ASSERT_EQ(out.exit_code, 0) << out.text;
  std::ifstream in(r.dir() / dump / "logs" / "rank-1.log");
  ASSERT_TRUE(in.good()) << "no logs/rank-1.log";
  int lines = 0;
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("step ", 0) != 0) continue;
    ++lines;
    // "step 2/3 | loss 8.1317 | ..." up to the loss: the same text on rank 0.
    const std::string head = line.substr(0, line.find(" | grad_norm"));
    EXPECT_NE(out.text.find(head), std::string::npos) << "rank 1 logged '" << head << "', rank 0 did not";
  }
  EXPECT_EQ(lines, 3);
}

using anvil::testing::LayoutParity;
TEST_P(LayoutParity, MatchesSingleProcess) { anvil::testing::expect_matches_single_process(GetParam()); }
INSTANTIATE_TEST_SUITE_P(Pipeline, LayoutParity,
                         ::testing::ValuesIn(anvil::testing::parity_cases([](const anvil::testing::Layout& l) {
                           return l.pp > 1 && l.cp == 1;
                         })),
                         anvil::testing::parity_case_name);

// A schedule file that cannot run is refused before the first step, on every
// rank with the same message, naming the cells that wait on each other.
TEST(Pipeline, ADeadlockedScheduleFileIsRefusedBeforeTheFirstStep) {
  auto& r = anvil::testing::runs();
  const std::filesystem::path csv = r.dir() / "deadlock.csv";
  std::ofstream(csv) << "0F0,0I0,0F1,0I1,0W0,0W1\n1F0,1F1,1I0,1I1,1W0,1W1\n";
  const anvil::testing::CommandOutput out =
      r.mpi(2, "deadlock_csv",
            anvil::testing::batch_flags(2, 2) + " " + anvil::testing::kPipeline +
                "2 --parallelism.pipeline_parallel_schedule_csv " + csv.string());
  EXPECT_NE(out.exit_code, 0);
  EXPECT_NE(out.text.find("deadlocks: rank 0 runs 0I0 (" + csv.string() + " row 1, column 2) waits for 1I0"),
            std::string::npos)
      << out.text;
  EXPECT_FALSE(std::regex_search(out.text, std::regex("step +1/[0-9]+ \\|"))) << "a step ran: " << out.text;
}

// Under pipeline parallelism every rank traces the profiled steps, so the
// bubbles can be read from all of them on one timeline: rank 1's trace has
// the pass, its actions and the clock origin that aligns it with rank 0's.
TEST(Pipeline, EveryRankTracesItsActions) {
  auto& r = anvil::testing::runs();
  const std::string dump = "pp_traces";
  std::filesystem::remove_all(r.dir() / dump);
  const anvil::testing::CommandOutput out =
      r.run(anvil::testing::layout("pp2_zero_bubble"), dump,
            anvil::testing::batch_flags(2, 2) + " --training.steps 1 --profiling.enable_profiling true");
  ASSERT_EQ(out.exit_code, 0) << out.text;
  for (const char* file : {"step-1.trace.json", "step-1.rank-1.trace.json"}) {
    std::ifstream in(r.dir() / dump / "profile_traces" / file);
    ASSERT_TRUE(in.good()) << "no " << file;
    const nlohmann::json trace = nlohmann::json::parse(in);
    EXPECT_GT(trace.at("otherData").at("clock_origin_us").get<double>(), 0) << file;
    std::set<std::string> names;
    for (const nlohmann::json& e : trace.at("traceEvents"))
      if (e.value("ph", "") == "X") names.insert(e.at("name").get<std::string>());
    const int rank = trace.at("otherData").at("rank").get<int>();
    EXPECT_EQ(rank, std::string(file) == "step-1.trace.json" ? 0 : 1);
    // Looped over 2 ranks: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3.
    for (const char* action : {"F0", "I1", "W1"})
      EXPECT_TRUE(names.count("pipeline." + std::to_string(rank) + action)) << file << " lacks " << action;
    EXPECT_TRUE(names.count("pipeline.pass")) << file;
  }
}
