// The GPU-cluster planner (estimate/gpu_estimate.h) against the published seeds
// and its own invariants. Nothing here is fitted: the seed rows hold the
// model to the published figures within the targets where it meets
// them, and state what it is (an upper bound) where it does not.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "anvil/cli/plan_cmd.h"
#include "anvil/core/error.h"
#include "anvil/estimate/gpu_estimate.h"
#include "anvil/estimate/gpu_hardware.h"
#include "anvil/estimate/gpu_search.h"
#include "anvil/estimate/gpu_seeds.h"

namespace anvil {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// Seed 000: every row, stage 0 and the last stage, within 10% of torch's max
// reserved memory as the seed published it.
TEST(GpuPlanSeed000, EveryRowWithinTenPercentOfMaxReserved) {
  const GpuHardware& hw = gpu_hardware("h100-80g");
  for (const Seed000Row& r : seed000_rows()) {
    const GpuStepEstimate e = estimate_gpu_run(r.spec, hw);
    ASSERT_EQ(e.stages.size(), 2u);
    const double e0 = relative_error(e.stages[0].reserved / kGiB, r.stage0_gib);
    const double el = relative_error(e.stages[1].reserved / kGiB, r.last_gib);
    std::printf("keep %d m %2d: stage 0 %.2f GiB (%+.1f%%), last %.2f GiB (%+.1f%%)\n", r.keep_outputs,
                r.micro_batches, e.stages[0].reserved / kGiB, 100 * e0, e.stages[1].reserved / kGiB, 100 * el);
    EXPECT_LE(std::abs(e0), 0.10) << "stage 0, keep " << r.keep_outputs << ", " << r.micro_batches << " micro-batches";
    EXPECT_LE(std::abs(el), 0.10) << "last stage, keep " << r.keep_outputs << ", " << r.micro_batches
                                  << " micro-batches";
  }
}

// Seed 001: the roofline (GEMMs at peak, attention at FlashAttention-2's best
// published efficiency, communication hidden where it overlaps) is an upper
// bound on speed, so every published WPS and MFU must be at or below it. The
// issue's 15% target is not met: the predictions are 39-56% above the
// published figures (docs/estimator.md), and this test prints each error.
TEST(GpuPlanSeed001, RooflineBoundsEveryPublishedRowFromAbove) {
  const GpuHardware& hw = gpu_hardware("a100-80g");
  for (const Seed001Row& r : seed001_rows()) {
    const GpuStepEstimate e = estimate_gpu_run(r.spec, hw);
    std::printf("%s b%d %s: WPS %.0f vs %.0f (%+.1f%%), MFU %.1f%% vs %.1f%%\n", r.model.c_str(), r.batch,
                r.ac.c_str(), e.tokens_per_second_per_gpu, r.wps,
                100 * relative_error(e.tokens_per_second_per_gpu, r.wps), 100 * e.mfu, r.mfu_pct);
    EXPECT_GE(e.tokens_per_second_per_gpu, r.wps) << r.model << " " << r.ac;
    EXPECT_GE(100 * e.mfu, r.mfu_pct) << r.model << " " << r.ac;
    EXPECT_LE(e.mfu, 1.0) << r.model << " " << r.ac;
    EXPECT_TRUE(e.fits) << r.model << " " << r.ac << " ran on 80 GB";
  }
}

// The published MFU is reproduced from the published WPS with the April 2024
// FLOPs per token (6·N with the embedding + 12·L·H·hd·s) and 312 TFLOP/s: a
// check that the era's definition is the one the table used.
TEST(GpuPlanSeed001, PublishedMfuFollowsFromWpsWithThatEraDefinition) {
  for (const Seed001Row& r : seed001_rows()) {
    const double mfu = torchtitan_flops_per_token(r.spec.model, r.spec.seq_len, TorchtitanEra::apr2024) * r.wps /
                       gpu_hardware("a100-80g").peak_bf16_flops;
    EXPECT_NEAR(100 * mfu, r.mfu_pct, 0.06) << r.model << " " << r.ac;
  }
}

// The footnote: Llama 2 70B at local batch 2 runs out of memory with selective
// AC (layer and op); local batch 1 with selective op and batch 2 with full fit.
TEST(GpuPlanSeed001, FootnoteOutOfMemoryRows) {
  const GpuHardware& hw = gpu_hardware("a100-80g");
  for (const FootnoteRow& r : seed001_footnote_rows()) {
    const GpuStepEstimate e = estimate_gpu_run(r.spec, hw);
    EXPECT_EQ(e.fits, r.ran) << "batch " << r.batch << " " << r.ac << ": " << e.max_reserved / kGiB << " GiB";
  }
}

GpuRunSpec llama3_8b_fsdp(int64_t shard) {
  GpuRunSpec s;
  s.model = model_flavor("llama3", "8B");
  s.seq_len = 8192;
  s.local_batch = 1;
  s.ac.mode = AcMode::selective_op;
  s.dp_shard = shard;
  return s;
}

TEST(GpuPlan, ShardedStatesFallAsOneOverTheShardCount) {
  const GpuHardware& hw = gpu_hardware("h100-80g");
  const GpuStageMemory m8 = estimate_gpu_run(llama3_8b_fsdp(8), hw).stages[0];
  const GpuStageMemory m32 = estimate_gpu_run(llama3_8b_fsdp(32), hw).stages[0];
  EXPECT_DOUBLE_EQ(m8.parameters, 4 * m32.parameters);
  EXPECT_DOUBLE_EQ(m8.optimizer, 4 * m32.optimizer);
  EXPECT_DOUBLE_EQ(m8.gradients, 4 * m32.gradients);
  // 16 bytes per parameter over the shards: fp32 weights, fp32 gradients, two AdamW moments.
  const double params = static_cast<double>(model_flavor("llama3", "8B").num_params());
  EXPECT_NEAR(m8.parameters + m8.optimizer + m8.gradients, 16 * params / 8, 1e-6 * params);
  // What is not sharded does not move: the gathered weights and the activations.
  EXPECT_DOUBLE_EQ(m8.gathered_params, m32.gathered_params);
  EXPECT_DOUBLE_EQ(m8.activations, m32.activations);
}

TEST(GpuPlan, KeptOutputsGrowByOneLogitsTensorPerMicroBatch) {
  const GpuHardware& hw = gpu_hardware("h100-80g");
  const std::vector<Seed000Row> rows = seed000_rows();
  const double logits = 4096.0 * 128256.0 * 2;  // one micro-batch's bf16 output
  for (size_t i = 0; i + 1 < 4; ++i) {
    const GpuStageMemory a = estimate_gpu_run(rows[i].spec, hw).stages[1];
    const GpuStageMemory b = estimate_gpu_run(rows[i + 1].spec, hw).stages[1];
    const double dm = rows[i + 1].micro_batches - rows[i].micro_batches;
    EXPECT_DOUBLE_EQ(b.kept_outputs - a.kept_outputs, dm * logits);
    EXPECT_DOUBLE_EQ(b.merged_outputs, rows[i + 1].micro_batches * logits);
  }
  // Without the bug nothing is kept, and stage 0 never holds outputs.
  for (size_t i = 4; i < 8; ++i) {
    const GpuStepEstimate e = estimate_gpu_run(rows[i].spec, hw);
    EXPECT_EQ(e.stages[1].kept_outputs, 0);
    EXPECT_EQ(e.stages[0].kept_outputs, 0);
  }
}

TEST(GpuPlan, OneFOneBHoldsPMicroBatchesOnTheFirstStage) {
  GpuRunSpec s = seed000_rows()[3].spec;  // 16 micro-batches, PP 2
  const GpuStepEstimate e = estimate_gpu_run(s, gpu_hardware("h100-80g"));
  EXPECT_EQ(e.stages[0].in_flight, 2);
  EXPECT_EQ(e.stages[1].in_flight, 1);
  s.pp_schedule = "GPipe";
  const GpuStepEstimate g = estimate_gpu_run(s, gpu_hardware("h100-80g"));
  EXPECT_EQ(g.stages[0].in_flight, 16);
  EXPECT_GT(g.stages[0].reserved, e.stages[0].reserved);
}

TEST(GpuPlan, CheckpointingTradesActivationsForRecompute) {
  const GpuHardware& hw = gpu_hardware("a100-80g");
  auto run = [&](AcMode mode) {
    GpuRunSpec s = llama3_8b_fsdp(64);
    s.ac.mode = mode;
    s.ac.every = 2;
    return estimate_gpu_run(s, hw);
  };
  const GpuStepEstimate none = run(AcMode::none), layer = run(AcMode::selective_layer),
                        op = run(AcMode::selective_op), full = run(AcMode::full);
  const double acts[] = {none.stages[0].activations, layer.stages[0].activations, op.stages[0].activations,
                         full.stages[0].activations};
  EXPECT_GT(acts[0], acts[1]);
  EXPECT_GT(acts[1], acts[2]);
  EXPECT_GT(acts[2], acts[3]);
  EXPECT_LT(none.compute_seconds, op.compute_seconds);
  EXPECT_LT(op.compute_seconds, layer.compute_seconds);
  EXPECT_LT(layer.compute_seconds, full.compute_seconds);
}

TEST(GpuPlan, EraDefinitionsOfFlopsPerTokenDifferByTheEmbedding) {
  const ModelArgs a = model_flavor("llama3", "8B");
  EXPECT_DOUBLE_EQ(torchtitan_flops_per_token(a, 8192, TorchtitanEra::apr2024) -
                       torchtitan_flops_per_token(a, 8192, TorchtitanEra::v0_1_0),
                   6.0 * static_cast<double>(a.num_embedding_params()));
}

TEST(GpuPlan, FasterHardwareStepsFaster) {
  const GpuRunSpec s = llama3_8b_fsdp(64);
  const GpuStepEstimate a = estimate_gpu_run(s, gpu_hardware("a100-80g"));
  const GpuStepEstimate h = estimate_gpu_run(s, gpu_hardware("h100-80g"));
  EXPECT_GT(h.tokens_per_second_per_gpu, 2 * a.tokens_per_second_per_gpu);
  EXPECT_DOUBLE_EQ(a.max_reserved, h.max_reserved);  // the same run holds the same bytes
}

TEST(GpuPlan, UnknownHardwareAndUnmodelledLayoutsAreRefusedByName) {
  try {
    gpu_hardware("b200");
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("b200"), std::string::npos);
    for (const std::string& n : known_gpu_hardware()) EXPECT_NE(msg.find(n), std::string::npos) << n;
  }
  GpuRunSpec s = llama3_8b_fsdp(1);
  EXPECT_THROW(estimate_gpu_run(s, gpu_hardware("a100-80g")), Error);
  s = seed000_rows()[0].spec;
  s.pp_schedule = "ZBVZeroBubble";
  EXPECT_THROW(estimate_gpu_run(s, gpu_hardware("a100-80g")), Error);
}

TEST(GpuPlanSearch, RowsFitUseEveryGpuAndComeFastestFirst) {
  const GpuHardware& hw = gpu_hardware("a100-80g");
  GpuRunSpec base;
  base.model = model_flavor("llama2", "70B");
  base.seq_len = 4096;
  const GpuPlanResult r = search_gpu_layouts(base, hw, 64);
  ASSERT_FALSE(r.rows.empty());
  EXPECT_GT(r.tried, static_cast<int64_t>(r.rows.size()));  // some layouts do not fit
  for (size_t i = 0; i < r.rows.size(); ++i) {
    EXPECT_EQ(r.rows[i].spec.gpus(), 64);
    EXPECT_TRUE(r.rows[i].estimate.fits);
    EXPECT_LE(r.rows[i].estimate.max_reserved, hw.hbm_bytes);
    if (i > 0) {
      EXPECT_GE(r.rows[i - 1].estimate.tokens_per_second_per_gpu, r.rows[i].estimate.tokens_per_second_per_gpu);
    }
  }
  // The footnote's layout that ran out of memory is not offered (under CP,
  // which splits its sequences, the same batch fits).
  for (const GpuPlanRow& row : r.rows)
    EXPECT_FALSE(row.spec.tp == 1 && row.spec.cp == 1 && row.spec.pp == 1 && row.spec.dp_replicate == 1 &&
                 row.spec.local_batch == 2 && row.spec.ac.mode == AcMode::selective_op);
}

// Context parallelism: each GPU holds 1/cp of every sequence's activations,
// pays the keys' and values' gathers (and their gradients' reduce-scatter)
// per layer, and FSDP shards over dp_shard × cp.
TEST(GpuPlan, ContextParallelSplitsTheSequenceAndChargesItsGathers) {
  const GpuHardware& hw = gpu_hardware("h100-80g");
  GpuRunSpec one;
  one.model = model_flavor("llama3", "8B");
  one.seq_len = 32768;
  one.dp_shard = 8;
  one.ac = {AcMode::full, 2};
  GpuRunSpec two = one;
  two.cp = 2;
  two.dp_shard = 4;  // the same 8 GPUs
  const GpuStepEstimate e1 = estimate_gpu_run(one, hw), e2 = estimate_gpu_run(two, hw);
  EXPECT_NEAR(e2.stages[0].activations / e1.stages[0].activations, 0.5, 1e-9);
  EXPECT_NEAR(e2.stages[0].parameters / e1.stages[0].parameters, 1.0, 1e-9);  // sharded over 4 x 2 as over 8
  EXPECT_EQ(e1.cp_comm_seconds, 0.0);
  EXPECT_GT(e2.cp_comm_seconds, 0.0);
  // The per-GPU rate counts the cp ranks a sequence occupies, as torchtitan does.
  EXPECT_LT(e2.tokens_per_second_per_gpu, e1.tokens_per_second_per_gpu);
  std::printf(
      "llama3/8B at 32K on 8 H100s, full AC: CP 1 %.0f tok/s/GPU, activations %.1f GiB; CP 2 %.0f tok/s/GPU, "
      "activations %.1f GiB, CP communication %.3f s of %.3f s\n",
      e1.tokens_per_second_per_gpu, e1.stages[0].activations / kGiB, e2.tokens_per_second_per_gpu,
      e2.stages[0].activations / kGiB, e2.cp_comm_seconds, e2.step_seconds);
}

// At 128K tokens the fastest 8B layout of 64 H100s splits the sequences
// (a sequence's activations and logits otherwise take TP 8 or full
// recomputation to fit); at 4K, where CP only adds gathers, it does not.
TEST(GpuPlanSearch, LongSequencesArePlannedWithContextParallelism) {
  GpuRunSpec base;
  base.model = model_flavor("llama3", "8B");
  for (const int64_t seq : {131072, 4096}) {
    base.seq_len = seq;
    const GpuPlanResult r = search_gpu_layouts(base, gpu_hardware("h100-80g"), 64);
    ASSERT_FALSE(r.rows.empty());
    int64_t without_cp = 0;
    for (const GpuPlanRow& row : r.rows) without_cp += row.spec.cp == 1;
    std::printf(
        "llama3/8B at %lld tokens on 64 H100s: %zu of %lld layouts fit (%lld without CP); the fastest: CP "
        "%lld, TP %lld, PP %lld, %.0f tok/s/GPU\n",
        static_cast<long long>(seq), r.rows.size(), static_cast<long long>(r.tried), static_cast<long long>(without_cp),
        static_cast<long long>(r.rows[0].spec.cp), static_cast<long long>(r.rows[0].spec.tp),
        static_cast<long long>(r.rows[0].spec.pp), r.rows[0].estimate.tokens_per_second_per_gpu);
    if (seq > 32768)
      EXPECT_GT(r.rows[0].spec.cp, 1);
    else
      EXPECT_EQ(r.rows[0].spec.cp, 1);
  }
}

TEST(GpuPlanCommand, EstimateAndPlanRun) {
  const std::string cfg = std::string(ANVIL_SOURCE_DIR) + "/configs/llama3_8b.toml";
  const JobConfig c = parse_config({cfg, "--activation_checkpoint.mode", "full"});
  EXPECT_EQ(gpu_estimate_command(c, "h100-80g", 16, false), 0);
  EXPECT_EQ(gpu_estimate_command(c, "h100-80g", 16, true), 0);
  EXPECT_EQ(plan_command({cfg, "--hardware", "a100-80g", "--gpus", "64", "--top", "3"}), 0);
  EXPECT_THROW(gpu_estimate_command(c, "h100-80g", 0, false), Error);
  EXPECT_THROW(plan_command({cfg, "--gpus", "8"}), Error);
}

}  // namespace
}  // namespace anvil
