// anvil estimate for a layout (per rank, without MPI) and the pre-flight check
// every rank runs with it. The estimate itself is held against the allocator
// in every parity case (tests/layout_parity.h) and in memory_test.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <sstream>

#include "anvil/cli/estimate_cmd.h"
#include "anvil/core/error.h"
#include "anvil/model/llama.h"
#include "anvil/train/estimate.h"
#include "anvil/train/preflight.h"
#include "test_util.h"

namespace anvil {
namespace {

// Whether `text` holds `part`, printing the text when not.
::testing::AssertionResult Holds(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "no '" << part << "' in: " << text;
}

JobConfig config(const std::string& flags) {
  std::vector<std::string> words;
  std::istringstream in(flags);
  for (std::string w; in >> w;) words.push_back(w);
  return parse_config(words);
}

size_t worst(const LayoutEstimate& est) {
  size_t w = 0;
  for (const RankEstimate& r : est.ranks) w = std::max(w, r.memory.peak_reserved);  // as the pre-flight check
  return w;
}

const std::string k8b = "--model.flavor 8B --training.seq_len 8192 --training.local_batch_size 1";

// Under FSDP over 64 ranks each rank holds 1/64 of the parameters' fp32
// master and bf16 copy, 6 bytes each (each group's shard padded to 32
// elements), and the AC mode changes the activations.
TEST(Estimate, FsdpDividesTheParametersAndAcChangesTheActivations) {
  const anvil::testing::CommandOutput out = anvil::testing::run_anvil(
      "estimate " ANVIL_SOURCE_DIR "/configs/llama3_8b.toml --parallelism.data_parallel_shard_degree 64 "
      "--activation_checkpoint.mode selective --json");
  ASSERT_EQ(out.exit_code, 0) << out.text;
  const nlohmann::json j = nlohmann::json::parse(out.text);
  ASSERT_EQ(j["ranks"].size(), 64u);
  const ModelArgs args = model_flavor("llama3", "8B");
  const double whole = 6.0 * static_cast<double>(padded_numel(llama_param_specs(args)));
  const double groups = static_cast<double>(args.n_layers + 2);
  for (const auto& r : j["ranks"]) {
    const double params = r["by_category"]["parameters"].get<double>();
    EXPECT_GE(params, whole / 64);
    EXPECT_LE(params, whole / 64 + groups * 32 * 6) << "rank " << r["rank"];  // 32 elements of fp32 + bf16 per group
  }
  std::printf("llama3/8B parameters: 6 bytes each, %.0f bytes; per FSDP rank of 64 %.0f (1/64 = %.0f)\n", whole,
              j["ranks"][0]["by_category"]["parameters"].get<double>(), whole / 64);
  EXPECT_GT(j["flops_per_token"].get<double>(), 0);
  EXPECT_GT(j["comm_bytes_per_step"]["data_parallel"].get<double>(), 0);
  // The activations follow the AC mode: none keeps the most, full the least,
  // selective (every 2nd layer) and selective op each something between.
  std::vector<double> act;
  for (const char* ac : {"--activation_checkpoint.mode none",
                         "--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option 2",
                         "--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op",
                         "--activation_checkpoint.mode full"}) {
    const LayoutEstimate est = estimate_layout(
        config(ANVIL_SOURCE_DIR "/configs/llama3_8b.toml --parallelism.data_parallel_shard_degree 64 " +
               std::string(ac)),
        args, 64);
    act.push_back(static_cast<double>(est.ranks[0].memory.bytes(MemCategory::activations)));
    std::printf("%-90s activations %.2f GiB\n", ac, act.back() / (1 << 30));
  }
  EXPECT_GT(act[0], act[1]);
  EXPECT_GT(act[0], act[2]);
  EXPECT_NE(act[1], act[2]);
  EXPECT_LT(act[3], act[1]);
  EXPECT_LT(act[3], act[2]);
}

// Block-causal attention's document bounds are a tensor like any other: the
// dry run allocates them and never reads them (its tensors are addresses
// only), however large. 8 sequences of 8192 tokens hold 512 KiB of bounds, a
// block of their own; the dry run once read them to pick the attention grid.
// Under expert parallelism the tokens a rank's experts receive depend on the
// routing: the dry run takes model.moe_estimate_load times the balanced share,
// and the received rows (per route: the experts' input, gate, up, SwiGLU and
// output, plus the returned rows) grow with it; the parameters do not. Each
// rank holds half the experts, so its parameters are below one process's.
TEST(Estimate, ExpertParallelMemoryFollowsTheNamedLoad) {
  const std::string moe = "--model.name qwen3 --model.flavor debugmodel_moe --training.seq_len 64 "
                          "--training.local_batch_size 2 --training.mixed_precision_param float32 ";
  const std::string ep = "--parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 1 "
                         "--parallelism.expert_parallel_degree 2 ";
  const auto at = [&](const std::string& flags, int ranks) {
    const JobConfig cfg = config(moe + flags);
    return estimate_layout(cfg, job_model_args(cfg), ranks).ranks[0].memory;
  };
  const MemoryEstimate single = at("", 1), balanced = at(ep, 2), twice = at(ep + "--model.moe_estimate_load 2", 2);
  EXPECT_LT(balanced.bytes(MemCategory::parameters), single.bytes(MemCategory::parameters));
  EXPECT_EQ(twice.bytes(MemCategory::parameters), balanced.bytes(MemCategory::parameters));
  EXPECT_GT(twice.bytes(MemCategory::activations), balanced.bytes(MemCategory::activations));
  // M·k = 2·64·2 routed rows per micro-batch and layer: the second load keeps, per layer, another M·k rows of
  // the experts' input (D 256) and their g, u, s (F 128) in f32 at least.
  const size_t extra_per_layer = static_cast<size_t>(256) * (256 + 3 * 128) * 4;
  EXPECT_GE(twice.bytes(MemCategory::activations) - balanced.bytes(MemCategory::activations), 6 * extra_per_layer);
}

TEST(Estimate, BlockCausalDryRunReadsNoDocuments) {
  const std::string flags = "--training.seq_len 8192 --training.local_batch_size 8";
  const JobConfig block_causal = config(flags);
  ASSERT_EQ(block_causal.model.attn_mask_type, "block_causal");
  const ModelArgs args = model_flavor("llama3", "debugmodel");
  const LayoutEstimate est = estimate_layout(block_causal, args, 1);
  const LayoutEstimate causal = estimate_layout(config(flags + " --model.attn_mask_type causal"), args, 1);
  const size_t bounds = size_t{8} * 2 * 8192 * 4;
  EXPECT_GE(est.ranks[0].memory.bytes(MemCategory::workspace),
            causal.ranks[0].memory.bytes(MemCategory::workspace) + bounds);
  EXPECT_EQ(est.ranks[0].memory.bytes(MemCategory::activations), causal.ranks[0].memory.bytes(MemCategory::activations));
}

TEST(Estimate, PipelineRanksDifferAndTheTableNamesEachRole) {
  const anvil::testing::CommandOutput out = anvil::testing::run_anvil(
      "estimate --parallelism.pipeline_parallel_degree 2 --parallelism.data_parallel_shard_degree 2 "
      "--training.local_batch_size 8 --parallelism.pipeline_parallel_microbatch_size 1");
  ASSERT_EQ(out.exit_code, 0) << out.text;
  EXPECT_TRUE(Holds(out.text, "(stage 0)"));
  EXPECT_TRUE(Holds(out.text, "(stage 1)"));
  EXPECT_TRUE(Holds(out.text, "activations"));
  // Bad usage says what is wrong.
  const anvil::testing::CommandOutput bad = anvil::testing::run_anvil("estimate --ranks zero");
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_TRUE(Holds(bad.text, "--ranks takes a positive integer, not 'zero'"));
}

// A run too big for the memory given is refused on each rank, naming the rank,
// its stage and its largest category first.
TEST(Preflight, RefusalNamesRankStageAndCategory) {
  const ModelArgs args = model_flavor("llama3", "8B");
  const size_t gib24 = size_t{24} << 30;
  const JobConfig cfg = config(k8b);
  try {
    (void)check_rank_fits(cfg, args, resolve_parallel(cfg, args, 1, 0), gib24, 1);
    FAIL() << "8B in one process fits in 24 GiB?";
  } catch (const Error& e) {
    EXPECT_TRUE(Holds(e.what(), "predicted peak memory of rank 0 is"));
    EXPECT_TRUE(Holds(e.what(), "largest first: optimizer_state"));
    EXPECT_TRUE(Holds(e.what(), "FSDP ranks with activation_checkpoint.mode = \"full\""));
  }
  const JobConfig pp = config(k8b + " --parallelism.pipeline_parallel_degree 2 --training.local_batch_size 2");
  try {
    (void)check_rank_fits(pp, args, resolve_parallel(pp, args, 2, 1), gib24, 2);
    FAIL() << "half of 8B fits in 12 GiB?";
  } catch (const Error& e) {
    EXPECT_TRUE(Holds(e.what(), "predicted peak memory of rank 1 (pipeline stage 1)"));
    EXPECT_TRUE(Holds(e.what(), "shared by 2 ranks"));
  }
  // What fits is not refused, and the estimate returned is the rank's own.
  const JobConfig small = config("--parallelism.pipeline_parallel_degree 2 --training.local_batch_size 2");
  const ModelArgs debug = model_flavor("llama3", "debugmodel");
  const ParallelDims par = resolve_parallel(small, debug, 2, 1);
  EXPECT_EQ(check_rank_fits(small, debug, par, gib24, 2).memory.peak,
            estimate_layout(small, debug, 2).ranks[1].memory.peak);
}

// Every change suggested fits by the estimate, and the nearest come first: a
// smaller micro-batch when that is enough, before more ranks.
TEST(Preflight, EverySuggestedChangeFits) {
  const ModelArgs args = model_flavor("llama3", "8B");
  const size_t gib24 = size_t{24} << 30;
  const JobConfig cfg = config(k8b);
  ASSERT_GT(worst(estimate_layout(cfg, args, 1)), gib24);
  const std::vector<FitOption> options = fitting_changes(cfg, args, 1, gib24);
  ASSERT_FALSE(options.empty());
  for (const FitOption& o : options) {
    const LayoutEstimate est = estimate_layout(config(k8b + " " + o.flags), args, o.world_size);
    EXPECT_LE(worst(est), gib24) << o.what;
    EXPECT_EQ(worst(est), o.peak) << o.what;
    std::printf("fits: %s (%s) on %d ranks: %.2f GiB\n", o.what.c_str(), o.flags.c_str(), o.world_size,
                static_cast<double>(o.peak) / (1 << 30));
  }
  // debugmodel at 4 x 2048 tokens: half the batch fits where the whole does not.
  const ModelArgs debug = model_flavor("llama3", "debugmodel");
  const std::string flags = "--training.seq_len 2048 --training.local_batch_size 4";
  const size_t whole = worst(estimate_layout(config(flags), debug, 1));
  const size_t half = worst(estimate_layout(config(flags + " --training.local_batch_size 2"), debug, 1));
  ASSERT_LT(half, whole);
  const std::vector<FitOption> near = fitting_changes(config(flags), debug, 1, (half + whole) / 2);
  ASSERT_FALSE(near.empty());
  EXPECT_EQ(near.front().world_size, 1);
  bool batch = false;
  for (const FitOption& o : near) batch = batch || o.what == "training.local_batch_size = 2";
  EXPECT_TRUE(batch) << near.front().what;
}

// `anvil estimate` without --ranks starts as many ranks as the degrees
// multiply to, the cp degree among them (it once left cp out and refused
// every context-parallel configuration).
TEST(EstimateCommand, TheImpliedWorldSizeCountsEveryDegree) {
  EXPECT_EQ(implied_world_size(config("--parallelism.context_parallel_degree 4")), 4);
  EXPECT_EQ(implied_world_size(config("--parallelism.context_parallel_degree 2 --parallelism.tensor_parallel_degree 2 "
                                      "--parallelism.data_parallel_shard_degree 2")),
            8);
  EXPECT_EQ(implied_world_size(config("--parallelism.pipeline_parallel_degree 2")), 2);
}

// The estimate refuses what training refuses: a sequence longer than the
// model's max_seq_len (the check sits in the layout's validation, which both run).
TEST(Estimate, ASequenceLongerThanTheModelsIsRefused) {
  const ModelArgs args = model_flavor("llama2", "7B");
  std::string error;
  try {
    (void)estimate_layout(config("--model.name llama2 --model.flavor 7B --training.seq_len 8192"), args, 1);
  } catch (const Error& e) {
    error = e.what();
  }
  EXPECT_TRUE(Holds(error, "training.seq_len 8192 exceeds llama2/7B's max_seq_len 4096")) << error;
}

// A long sequence whose activations do not fit: the refusal offers context
// parallelism, and the run it offers fits by the same estimate. llama3/25M at
// 2048 tokens, full activation checkpointing (no lighter mode to offer), 4
// sequences per micro-batch, given the memory between the CP 4 and the CP 1
// estimates.
TEST(Preflight, ALongSequenceIsOfferedContextParallelism) {
  const ModelArgs args = model_flavor("llama3", "25M");
  const std::string flags =
      "--model.flavor 25M --training.seq_len 2048 --training.local_batch_size 4 "
      "--activation_checkpoint.mode full";
  const size_t one = worst(estimate_layout(config(flags), args, 1));
  const size_t cp4 = worst(estimate_layout(config(flags + " --parallelism.context_parallel_degree 4"), args, 4));
  ASSERT_LT(cp4, one);
  const size_t given = (cp4 + one) / 2;
  const JobConfig cfg = config(flags);
  try {
    (void)check_rank_fits(cfg, args, resolve_parallel(cfg, args, 1, 0), given, 1);
    FAIL() << "fits in " << given << " bytes?";
  } catch (const Error& e) {
    EXPECT_TRUE(Holds(e.what(), "parallelism.context_parallel_degree = ")) << e.what();
    std::printf("%s\n", e.what());
  }
  bool offered = false;
  for (const FitOption& o : fitting_changes(cfg, args, 1, given)) {
    if (o.what.find("context_parallel_degree") == std::string::npos) continue;
    offered = true;
    EXPECT_LE(worst(estimate_layout(config(flags + " " + o.flags), args, o.world_size)), given) << o.what;
  }
  EXPECT_TRUE(offered);
}

// Sequence parallelism splits the tokens of the micro-batch that runs: under
// pipeline parallelism a pipeline micro-batch's, not the local batch's. An odd
// seq_len with local batch 2 and pipeline micro-batches of 1 divides as a local
// batch (66 tokens) but not as the micro-batch that runs (33): the layout check
// refuses it before any rank starts, naming the micro-batch size, instead of
// the first forward failing on a shape.
TEST(Estimate, SequenceParallelChecksThePipelineMicroBatch) {
  const ModelArgs args = model_flavor("llama3", "debugmodel");
  const JobConfig bad = config(
      "--parallelism.tensor_parallel_degree 2 --parallelism.pipeline_parallel_degree 2 "
      "--parallelism.data_parallel_shard_degree 1 --parallelism.pipeline_parallel_schedule GPipe "
      "--training.seq_len 33 --training.local_batch_size 2 --parallelism.pipeline_parallel_microbatch_size 1");
  const std::string err = anvil::testing::error_of([&] { (void)resolve_parallel(bad, args, 4, 0); });
  EXPECT_NE(err.find("33 tokens of a micro-batch"), std::string::npos) << err;
  EXPECT_NE(err.find("pipeline_parallel_microbatch_size 1"), std::string::npos) << err;
  // The estimator takes the same check.
  EXPECT_THROW((void)estimate_layout(bad, args, 4), Error);
  // Micro-batches of 2 rows (66 tokens) divide.
  JobConfig good = bad;
  good.parallelism.pipeline_parallel_microbatch_size = 2;
  good.training.local_batch_size = 4;
  EXPECT_NO_THROW((void)resolve_parallel(good, args, 4, 0));
}

}  // namespace
}  // namespace anvil
