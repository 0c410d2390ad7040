// The trainer's layout component and single-stage schedule, in one process:
// what train() relies on them for, checked without running train().
#include "anvil/train/parallelize.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "anvil/core/allocator.h"
#include "anvil/core/safetensors.h"
#include "anvil/model/llama.h"
#include "anvil/ops/grad_norm.h"
#include "anvil/train/checkpoint.h"
#include "anvil/train/config.h"
#include "anvil/train/optimizer.h"
#include "anvil/train/forward_backward.h"
#include "anvil/train/parallel_dims.h"
#include "test_util.h"

namespace anvil {
namespace {
namespace fs = std::filesystem;
using testing::same_bytes;

JobConfig small_config(int64_t seed = 0) {
  JobConfig cfg;
  cfg.model.flavor = "debugmodel";
  cfg.training.seq_len = 32;
  cfg.training.local_batch_size = 2;
  cfg.training.mixed_precision_param = "float32";
  cfg.training.seed = seed;
  cfg.optimizer.lr = 1e-3;
  return cfg;
}

MicroBatches random_batches(int64_t n, int64_t B, int64_t T, int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(vocab - 1));
  MicroBatches mb;
  for (int64_t i = 0; i < n; ++i) {
    mb.tokens.push_back(Tensor::empty({B, T}, DType::i32, MemCategory::workspace, "test.tokens"));
    mb.targets.push_back(Tensor::empty({B, T}, DType::i32, MemCategory::workspace, "test.targets"));
    for (int64_t j = 0; j < B * T; ++j) {
      mb.tokens.back().data<int32_t>()[j] = token(rng);
      mb.targets.back().data<int32_t>()[j] = token(rng);
    }
  }
  return mb;
}

size_t live_optimizer_bytes() {
  return TrackingAllocator::instance().stats().live[static_cast<int>(MemCategory::optimizer_state)];
}

// One step as train() drives it: begin, the schedule, finish, norm, AdamW, release.
double step(ParallelizedModel& layout, const MicroBatches& mb, int64_t step_number) {
  layout.begin_step();
  const int64_t tokens = mb.size() * mb.tokens[0].numel();
  const ForwardBackwardResult r = layout.forward_backward(mb, 1.0f / static_cast<float>(tokens), AcPolicy{}, {});
  layout.finish_backward();
  const double norm = layout.grad_norm();
  layout.optimizer_step(1.0, step_number, 1.0f);
  layout.release_grads();
  EXPECT_EQ(r.loss_tokens, tokens);
  EXPECT_EQ(r.stopped_after, 0);
  return norm;
}

TEST(ParallelizedModel, MomentsAppearAtTheFirstOptimizerStepAndTheNormIsTheGradients) {
  const JobConfig cfg = small_config();
  const ModelArgs args = job_model_args(cfg);
  const ParallelDims par = setup_parallel(cfg, args);
  const size_t before = live_optimizer_bytes();
  ParallelizedModel layout(cfg, args, par, DType::f32);
  EXPECT_EQ(live_optimizer_bytes(), before) << "AdamW's moments must not exist before the first optimizer step";

  const MicroBatches mb = random_batches(2, 2, 32, args.vocab_size, 1);
  layout.begin_step();
  forward_backward_single_stage(layout.model(), mb, 1.0f / 128, AcPolicy{}, {});
  layout.finish_backward();
  const Tensor grads[] = {layout.model().params().grad_flat()};
  const double expected = std::sqrt(grad_sum_of_squares(grads));
  EXPECT_GT(expected, 0);
  EXPECT_EQ(layout.grad_norm(), expected);
  EXPECT_EQ(live_optimizer_bytes(), before);
  layout.optimizer_step(1.0, 1, 1.0f);
  EXPECT_EQ(live_optimizer_bytes() - before, 2 * sizeof(float) * static_cast<size_t>(layout.model().params().numel()));
  layout.release_grads();
  EXPECT_FALSE(layout.model().params().grad_flat().defined());
}

// A layout under `optimizer` trained a step and saved to `folder`; another,
// from another seed, loaded from the save: the same weights, and after a
// second step from there (the optimizer's state restored too) the same again.
void expect_checkpoint_restores_bit_for_bit(const std::string& optimizer, const fs::path& folder) {
  JobConfig cfg = small_config();
  cfg.optimizer.name = optimizer;
  const ModelArgs args = job_model_args(cfg);
  const ParallelDims par = setup_parallel(cfg, args);
  const MicroBatches first = random_batches(2, 2, 32, args.vocab_size, 2);
  const MicroBatches second = random_batches(2, 2, 32, args.vocab_size, 3);

  ParallelizedModel a(cfg, args, par, DType::f32);
  step(a, first, 1);
  fs::remove_all(folder);
  Checkpointer ckpt(folder.string(), 0);
  a.save_checkpoint(ckpt, 1, /*model_only=*/false, DType::f32, [&] {
    return CheckpointMeta{nlohmann::json::object(), {}, "", "llama3/debugmodel", {}};
  });
  ckpt.wait();

  // Another seed, so only the checkpoint can make the two agree.
  JobConfig other = small_config(7);
  other.optimizer.name = optimizer;
  ParallelizedModel b(other, args, par, DType::f32);
  ASSERT_FALSE(same_bytes(a.model().params().master_flat(), b.model().params().master_flat()));
  const nlohmann::json state = b.load_checkpoint(ckpt, 1);
  EXPECT_EQ(state.value("model", std::string()), "llama3/debugmodel");
  EXPECT_TRUE(same_bytes(a.model().params().master_flat(), b.model().params().master_flat()));
  // The moments too: a second step from the same state gives the same weights.
  const double norm_a = step(a, second, 2), norm_b = step(b, second, 2);
  EXPECT_EQ(norm_a, norm_b);
  EXPECT_TRUE(same_bytes(a.model().params().master_flat(), b.model().params().master_flat()));
}

TEST(ParallelizedModel, ACheckpointRestoresWeightsAndMomentsBitForBit) {
  expect_checkpoint_restores_bit_for_bit("AdamW", testing::scratch_root() / "parallelize_test_ckpt");
}

// Muon's state: one fp32 momentum per element of its matrices, AdamW's two
// moments for the rest (the embedding, norms, the head; a mixture of experts'
// router), counted here from the names alone.
TEST(MuonLayout, StateIsOneMomentumPerMatrixElementAndTwoMomentsPerOtherElement) {
  for (const std::string flavor : {"debugmodel", "debugmodel_moe"}) {
    JobConfig cfg = small_config();
    cfg.model.name = flavor == "debugmodel" ? "llama3" : "qwen3";
    cfg.model.flavor = flavor;
    cfg.optimizer.name = "Muon";
    const ModelArgs args = job_model_args(cfg);
    const ParallelDims par = setup_parallel(cfg, args);
    const size_t before = live_optimizer_bytes();
    ParallelizedModel layout(cfg, args, par, DType::f32);
    int64_t matrices = 0, others = 0, experts = 0;
    for (const ParamSpec& s : layout.model().params().specs()) {
      const bool router = s.name.ends_with(".mlp.gate.weight");
      const bool matrix = s.name.find("layers.") != std::string::npos && s.shape.size() == 2 && !router;
      (matrix ? matrices : others) += s.numel();
      experts += s.name.find(".experts.") != std::string::npos;
    }
    EXPECT_GT(matrices, 0);
    EXPECT_EQ(experts > 0, flavor != "debugmodel") << "each expert's matrices are parameters of their own";
    step(layout, random_batches(1, 2, 32, args.vocab_size, 1), 1);
    EXPECT_EQ(live_optimizer_bytes() - before, static_cast<size_t>(4 * matrices + 8 * others)) << flavor;
  }
}

TEST(MuonLayout, ACheckpointRestoresWeightsAndMomentumBitForBitAndRefusesAnotherOptimizer) {
  const fs::path folder = testing::scratch_root() / "parallelize_test_muon_ckpt";
  expect_checkpoint_restores_bit_for_bit("Muon", folder);
  // torch.optim.Muon's name for the state of a matrix; AdamW's for the embedding.
  const SafetensorsFile saved = load_safetensors((folder / "step-1" / "optimizer.safetensors").string());
  EXPECT_TRUE(saved.tensors.contains("model.layers.0.self_attn.q_proj.weight.momentum_buffer"));
  EXPECT_FALSE(saved.tensors.contains("model.layers.0.self_attn.q_proj.weight.exp_avg_sq"));
  EXPECT_TRUE(saved.tensors.contains("model.embed_tokens.weight.exp_avg_sq"));

  const JobConfig cfg = small_config();
  const ModelArgs args = job_model_args(cfg);
  const ParallelDims par = setup_parallel(cfg, args);
  ParallelizedModel adamw(cfg, args, par, DType::f32);
  const Checkpointer ckpt(folder.string(), 0);
  try {
    adamw.load_checkpoint(ckpt, 1);
    ADD_FAILURE() << "a Muon checkpoint resumed under AdamW";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("holds the state of optimizer.name = \"Muon\", and this run sets "
                                         "\"AdamW\"; a run cannot change its optimizer on resume"),
              std::string::npos)
        << e.what();
  }
}

// Each way the groups can be wrong gets one line naming the parameter and the fix.
TEST(MuonLayout, GroupsThatLeaveAParameterWithoutOrWithTwoOptimizersOrGiveMuonAVectorAreRefused) {
  // The two lists' patterns ("" keeps the default) against the debug model's parameters.
  const auto error_of = [](const std::string& muon_params, const std::string& adamw_params) {
    JobConfig cfg = small_config();
    cfg.optimizer.name = "Muon";
    if (!muon_params.empty()) cfg.optimizer.muon_params = muon_params;
    if (!adamw_params.empty()) cfg.optimizer.adamw_params = adamw_params;
    ParamStore ps(llama_param_specs(job_model_args(cfg)), DType::f32, /*allocate=*/false);
    try {
      (void)muon_matrices(optimizer_config(cfg), ps.specs());
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(error_of("", ""), "");
  EXPECT_EQ(error_of("", "model.embed_tokens.weight,lm_head.weight,*norm.weight"), "")
      << "a dense model has no router to name";
  EXPECT_EQ(error_of("", "model.embed_tokens.weight,lm_head.weight"),
            "optimizer.name = \"Muon\": parameter model.layers.0.input_layernorm.weight matches neither "
            "optimizer.muon_params nor optimizer.adamw_params, so no optimizer would update it; add a pattern that "
            "names it to one of the two");
  EXPECT_NE(error_of("model.layers.*", "").find("parameter model.layers.0.input_layernorm.weight matches both "
                                                 "optimizer.muon_params and optimizer.adamw_params"),
            std::string::npos);
  const std::string vector_error =
      error_of("model.layers.*", "model.embed_tokens.weight,lm_head.weight,model.norm.weight");
  EXPECT_NE(vector_error.find("parameter model.layers.0.input_layernorm.weight has 1 dimensions, and Muon "
                              "orthogonalises matrices only"),
            std::string::npos)
      << vector_error;
}

TEST(SingleStageSchedule, StopsAfterTheMicroBatchAtWhichAStopIsAgreed) {
  const JobConfig cfg = small_config();
  const ModelArgs args = job_model_args(cfg);
  const ParallelDims par = setup_parallel(cfg, args);
  ParallelizedModel layout(cfg, args, par, DType::f32);
  const MicroBatches mb = random_batches(3, 2, 32, args.vocab_size, 4);
  double expected_loss = 0;
  for (int i = 0; i < 2; ++i) expected_loss += evaluate_single_stage(layout.model(), mb.tokens[i], mb.targets[i]).loss_sum;

  std::vector<std::pair<int64_t, int64_t>> calls;
  int asked = 0;
  layout.begin_step();
  const ForwardBackwardResult r = forward_backward_single_stage(
      layout.model(), mb, 1.0f / 192, AcPolicy{},
      {[&](int64_t i, int64_t n) { calls.emplace_back(i, n); }, [&] { return ++asked == 2; }});
  EXPECT_EQ(r.stopped_after, 2);
  EXPECT_EQ(asked, 2);
  EXPECT_EQ(calls, (std::vector<std::pair<int64_t, int64_t>>{{0, 3}, {1, 3}}));
  EXPECT_EQ(r.loss_tokens, 2 * 2 * 32);
  EXPECT_NEAR(r.loss_sum, expected_loss, 1e-6 * expected_loss);
}

// Expert parallelism splits a mixture of experts over exactly the DDP ranks;
// anything else is refused before any rank allocates, naming the keys.
TEST(ExpertParallelLayout, IsRefusedWhereItDoesNotApply) {
  const auto error_of = [](const std::string& flags, int world) {
    std::vector<std::string> args;
    std::istringstream in(flags);
    for (std::string w; in >> w;) args.push_back(w);
    const JobConfig cfg = parse_config(args);
    try {
      (void)resolve_parallel(cfg, job_model_args(cfg), world, 0);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  const std::string moe = "--model.name qwen3 --model.flavor debugmodel_moe --parallelism.expert_parallel_degree 2 ";
  EXPECT_EQ(error_of(moe + "--parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 1",
                     2),
            "");
  EXPECT_NE(error_of("--parallelism.expert_parallel_degree 2 --parallelism.data_parallel_replicate_degree 2 "
                     "--parallelism.data_parallel_shard_degree 1",
                     2)
                .find("has none"),
            std::string::npos);
  // Over FSDP: the experts split over consecutive shard ranks, whole on each (2 ranks) or sharded (4).
  EXPECT_EQ(error_of(moe + "--parallelism.data_parallel_shard_degree 2", 2), "");
  EXPECT_EQ(error_of(moe + "--parallelism.data_parallel_shard_degree 4", 4), "");
  EXPECT_EQ(
      error_of(moe + "--parallelism.data_parallel_shard_degree 2 --parallelism.data_parallel_replicate_degree 2", 4),
      "");
  // DDP replicas of the experts and an ep that does not divide dp_shard are refused.
  EXPECT_NE(
      error_of(moe + "--parallelism.data_parallel_replicate_degree 4 --parallelism.data_parallel_shard_degree 1", 4)
          .find("equal data_parallel_replicate_degree (now 4)"),
      std::string::npos);
  EXPECT_NE(
      error_of(moe + "--parallelism.data_parallel_shard_degree 3", 3).find("must divide data_parallel_shard_degree 3"),
      std::string::npos);
  // Each pipeline stage's data-parallel ranks split its layers' experts.
  EXPECT_EQ(error_of(moe + "--parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 1 "
                           "--parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_microbatch_size 1 "
                           "--training.local_batch_size 2",
                     4),
            "");
  EXPECT_NE(error_of("--model.name qwen3 --model.flavor debugmodel_moe --parallelism.expert_parallel_degree 3 "
                     "--parallelism.data_parallel_replicate_degree 3 --parallelism.data_parallel_shard_degree 1",
                     3)
                .find("parallelism.expert_parallel_degree 3 must divide qwen3/debugmodel_moe's 8 experts"),
            std::string::npos);
  // Expert parallelism takes data-parallel ranks: over tensor-parallel ones alone it has none.
  EXPECT_NE(error_of(moe + "--parallelism.tensor_parallel_degree 2 --parallelism.data_parallel_shard_degree 1", 2)
                .find("splits the experts over data-parallel ranks"),
            std::string::npos);
  // Tensor parallelism splits every expert's width, with expert parallelism over DDP too; over FSDP
  // that is refused. Context parallelism splits a mixture of experts' sequences, not with expert parallelism.
  EXPECT_EQ(error_of(moe + "--parallelism.tensor_parallel_degree 2 --parallelism.data_parallel_shard_degree 1 "
                           "--parallelism.data_parallel_replicate_degree 2",
                     4),
            "");
  EXPECT_EQ(error_of("--model.name qwen3 --model.flavor debugmodel_moe --parallelism.tensor_parallel_degree 2 "
                     "--parallelism.data_parallel_shard_degree 1",
                     2),
            "");
  EXPECT_NE(error_of(moe + "--parallelism.tensor_parallel_degree 2 --parallelism.data_parallel_shard_degree 2", 4)
                .find("runs over DDP only"),
            std::string::npos);
  EXPECT_EQ(error_of("--model.name qwen3 --model.flavor debugmodel_moe --parallelism.context_parallel_degree 2 "
                     "--parallelism.data_parallel_shard_degree 1",
                     2),
            "");
  EXPECT_NE(error_of(moe + "--parallelism.context_parallel_degree 2 --parallelism.data_parallel_shard_degree 2", 4)
                .find("expert parallelism over context-parallel ranks is not built yet"),
            std::string::npos);
}

}  // namespace
}  // namespace anvil
