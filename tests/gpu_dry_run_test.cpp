// The dry run of the GPU path (dry_run_rank on cuda:0): the trainer's own steps
// over a device pool on a fake GPU, with no GPU and no CUDA. Held to
// PyTorch's measured memory for the same runs (../shared/DEVICE.md: a
// torchtitan-style FSDP2 bf16/fp32 run on one H200) from above, and from below
// to a closed form of what the step must hold, so a dry run that misses
// allocations cannot pass.
#include <gtest/gtest.h>

#include <cstdio>
#include <sstream>

#include "anvil/core/error.h"
#include "anvil/model/llama.h"
#include "anvil/model/params.h"
#include "anvil/train/estimate.h"
#include "anvil/train/gpu_job.h"
#include "test_util.h"

namespace anvil {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

JobConfig config(const std::string& flags) {
  std::vector<std::string> words;
  std::istringstream in(flags);
  for (std::string w; in >> w;) words.push_back(w);
  return parse_config(words);
}

int64_t parameters(const ModelArgs& args) {
  const ParamStore store(llama_param_specs(args), DType::f32, /*allocate=*/false);
  int64_t n = 0;
  for (const ParamSpec& s : store.specs()) n += s.numel();
  return n;
}

struct GpuRow {
  const char* name;
  const char* flags;
  int64_t published_parameters;  // ../shared/REFERENCE.md
  const char* ac;                // activation_checkpoint.mode
  double torch_allocated_gib;    // DEVICE.md's PyTorch run; 0: not measured
  double torch_reserved_gib;
};

// The bytes the step must hold at its peak, at least: fp32 master weights,
// gradients and AdamW's two moments (16 bytes per parameter), and the bf16
// activations every block keeps for its backward: under no AC at least its
// input, its attention's output and the SwiGLU's gate and up projections;
// under full AC its input alone.
double lower_bound_bytes(const ModelArgs& a, int64_t P, int64_t tokens, const std::string& ac) {
  const double per_block = ac == "full" ? static_cast<double>(a.dim)
                                        : 2.0 * static_cast<double>(a.dim) + 2.0 * static_cast<double>(a.ffn_hidden_dim());
  return 16.0 * static_cast<double>(P) + static_cast<double>(a.n_layers) * static_cast<double>(tokens) * per_block * 2;
}

class GpuDryRun : public ::testing::TestWithParam<GpuRow> {};

TEST_P(GpuDryRun, MemoryLiesBetweenTheClosedFormAndPyTorchs) {
  const GpuRow& row = GetParam();
  const JobConfig cfg = config(std::string("--job.config_file ") + ANVIL_SOURCE_DIR + "/configs/" + row.flags +
                               " --model.attn_mask_type causal --training.seq_len 8192"
                               " --training.local_batch_size 1 --activation_checkpoint.mode " + row.ac);
  const ModelArgs args = job_model_args(cfg);
  const int64_t P = parameters(args);
  EXPECT_EQ(P, row.published_parameters);
  const RankEstimate r = dry_run_rank(cfg, args, 1, 0, nullptr, Device::cuda(0));
  ASSERT_FALSE(r.device.is_cpu()) << "the dry run did not take the GPU path";
  const MemoryEstimate& gpu = r.device_memory;
  const double allocated = static_cast<double>(gpu.peak_total), reserved = static_cast<double>(gpu.peak_reserved);
  const double floor = lower_bound_bytes(args, P, 8192, row.ac);
  std::printf("%s, seq 8192, batch 1, AC %s: GPU allocated peak %.2f GiB, reserved %.2f GiB; closed-form floor "
              "%.2f GiB; PyTorch %.1f GiB allocated, %.1f GiB reserved; host peak %.2f GiB\n",
              row.name, row.ac, allocated / kGiB, reserved / kGiB, floor / kGiB, row.torch_allocated_gib,
              row.torch_reserved_gib, static_cast<double>(r.memory.peak_reserved) / kGiB);
  for (int c = 0; c < kNumMemCategories; ++c)
    std::printf("  %-14s %8.3f GiB\n", category_name(static_cast<MemCategory>(c)),
                static_cast<double>(gpu.peak[c]) / kGiB);
  EXPECT_GE(allocated, floor);
  EXPECT_GE(reserved, allocated);
  if (row.torch_allocated_gib > 0) {
    EXPECT_LE(allocated, row.torch_allocated_gib * kGiB);
  }
  EXPECT_LE(reserved, row.torch_reserved_gib * kGiB);
  // The state is on the GPU: its categories hold the 16 bytes per parameter, the host only the job's edges.
  EXPECT_GE(gpu.bytes(MemCategory::parameters) + gpu.bytes(MemCategory::gradients) +
                gpu.bytes(MemCategory::optimizer_state),
            static_cast<size_t>(16 * P));
  EXPECT_LT(r.memory.bytes(MemCategory::parameters), static_cast<size_t>(P));
}

INSTANTIATE_TEST_SUITE_P(
    Llama3, GpuDryRun,
    ::testing::Values(GpuRow{"llama3 1B", "llama3_1b.toml", 1'235'814'400, "none", 37.7, 43.6},
                      GpuRow{"llama3 8B", "llama3_8b.toml", 8'030'261'248, "full", 0, 137.4}),
    [](const ::testing::TestParamInfo<GpuRow>& info) {
      return std::string(info.param.flags).substr(0, std::string(info.param.flags).find('.'));
    });

// What a GPU cannot run yet is refused before anything is built, naming what to change.
TEST(GpuDryRun, WhatAGpuCannotRunYetIsRefusedWithTheKeyToChange) {
  const ModelArgs dense = model_flavor("llama3", "debugmodel");
  const auto refusal = [](const std::string& flags, const ModelArgs& args, int world_size) {
    return anvil::testing::error_of(
        [&] { dry_run_rank(config(flags), args, world_size, 0, nullptr, Device::cuda(0)); });
  };
  const std::string ranks = refusal("", dense, 2);
  EXPECT_NE(ranks.find("one process"), std::string::npos) << ranks;
  const std::string moe = refusal("", model_flavor("qwen3", "debugmodel_moe"), 1);
  EXPECT_NE(moe.find("mixture-of-experts"), std::string::npos) << moe;
  EXPECT_EQ(refusal("--model.attn_mask_type causal", dense, 1), "");
  EXPECT_EQ(refusal("--model.attn_mask_type block_causal", dense, 1), "") << "block-causal runs on a GPU";
}

}  // namespace
}  // namespace anvil
