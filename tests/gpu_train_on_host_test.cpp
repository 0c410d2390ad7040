// The trainer on a GPU, end to end, without one: `train()` with job.device
// cuda runs on the host-backed stand-in GPU of tests/host_backed_gpu.h (its
// memory host memory, its kernels written from the CUDA twins' contracts).
// What this proves is everything above the kernels: the job's device, the
// fit check and banner against the GPU's memory, the model and its state on
// the device, the batches copied over, the metrics' device figures (equal,
// category by category, to the dry run of the GPU path), op times from the
// device's stamps, and checkpoints that a CPU run resumes and back. The
// kernels' own bodies are proved against the CPU ops in tests/cuda/; what only
// a GPU can show is bench/gpu/check.sh's.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "anvil/core/device.h"
#include "anvil/core/error.h"
#include "anvil/train/config.h"
#include "anvil/train/estimate.h"
#include "anvil/train/trainer.h"
#include "host_backed_gpu.h"
#include "test_util.h"

namespace fs = std::filesystem;

namespace anvil {
namespace {

class GpuTrainOnHost : public ::testing::Test {
 protected:
  void SetUp() override {
    set_device_runtime(DeviceKind::cuda, &runtime);
    set_gpu_kernels(&kernels);
    root = testing::scratch_root() / "anvil_gpu_train_on_host";
    fs::remove_all(root);
    fs::create_directories(root);
    std::ofstream f(root / "text.txt");
    for (int i = 0; i < 200; ++i)
      f << "The jury said the election was conducted well, and the city thanked them for it. Number " << i % 13
        << " of the reports praised the manner of the work.\n";
  }
  void TearDown() override {
    set_gpu_kernels(nullptr);
    set_device_runtime(DeviceKind::cuda, nullptr);
  }

  // A small causal (the GPU's attention) run of the debug model, logged every
  // step, saved every 2, with op times on.
  std::vector<std::string> args(const std::string& device, const std::string& dump, const std::string& precision,
                                int steps = 4) const {
    std::vector<std::string> a = {
        "--training.dataset", "text", "--training.dataset_path", (root / "text.txt").string(),
        "--training.seq_len", "16", "--training.local_batch_size", "2", "--training.steps", std::to_string(steps),
        "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "2", "--optimizer.lr", "3e-3",
        "--model.attn_mask_type", "causal", "--training.mixed_precision_param", precision,
        "--checkpoint.enable", "--checkpoint.interval", "2", "--profiling.op_times",
        "--job.device", device, "--job.dump_folder", (root / dump).string()};
    return a;
  }

  // metrics.jsonl's step lines, in order.
  std::vector<nlohmann::json> metrics(const std::string& dump) const {
    std::ifstream in(root / dump / "metrics.jsonl");
    std::vector<nlohmann::json> rows;
    for (std::string line; std::getline(in, line);) {
      nlohmann::json j = nlohmann::json::parse(line);
      if (j.contains("loss")) rows.push_back(std::move(j));
    }
    return rows;
  }

  // A copy of `dump` holding only its checkpoint of step 2, to resume from.
  void resumable_copy(const std::string& from, const std::string& to) const {
    fs::create_directories(root / to);
    fs::copy(root / from / "checkpoint", root / to / "checkpoint", fs::copy_options::recursive);
    for (const auto& e : fs::directory_iterator(root / to / "checkpoint"))
      if (e.path().filename() != "step-2") fs::remove_all(e.path());
  }

  testing::HostBackedGpu runtime;
  testing::HostGpuKernels kernels;
  fs::path root;
};

double rel(double a, double b) { return std::abs(a - b) / std::max(std::abs(b), 1e-30); }

TEST_F(GpuTrainOnHost, TrainsAsTheCpuDoesWithTheDryRunsMemoryAndResumesAcrossDevices) {
  const TrainResult cpu = train(parse_config(args("cpu", "cpu", "float32")));
  const TrainResult gpu = train(parse_config(args("cuda", "gpu", "float32")));
  ASSERT_EQ(cpu.steps_done, 4);
  ASSERT_EQ(gpu.steps_done, 4);
  const std::vector<nlohmann::json> c = metrics("cpu"), g = metrics("gpu");
  ASSERT_EQ(c.size(), 4u);
  ASSERT_EQ(g.size(), 4u);
  // fp32: the stand-in's products add in double, the CPU's in f32 tiles, so
  // the two agree to f32 rounding compounded over four steps, not bit for bit.
  for (size_t i = 0; i < 4; ++i) {
    SCOPED_TRACE("step " + std::to_string(i + 1));
    EXPECT_LT(rel(g[i]["loss"], c[i]["loss"]), 1e-5) << g[i]["loss"] << " vs " << c[i]["loss"];
    EXPECT_LT(rel(g[i]["grad_norm"], c[i]["grad_norm"]), 1e-5) << g[i]["grad_norm"] << " vs " << c[i]["grad_norm"];
    EXPECT_FALSE(c[i].contains("device"));
    ASSERT_TRUE(g[i].contains("device"));
    EXPECT_EQ(g[i]["device"]["name"], "cuda:0");
  }

  // Every category's device peak is the dry run's to the byte, and so are the
  // reserved bytes (the stand-in's pool runs the device pool's rules, as the
  // dry run's fake device does).
  const JobConfig gcfg = parse_config(args("cuda", "gpu-estimate", "float32"));
  const RankEstimate est = estimate_layout(gcfg, job_model_args(gcfg), 1, Device::cuda(0)).ranks.front();
  ASSERT_EQ(est.device, Device::cuda(0));
  size_t reserved = 0;
  for (int k = 0; k < kNumMemCategories; ++k) {
    const char* cat = category_name(static_cast<MemCategory>(k));
    size_t peak = 0;
    for (const nlohmann::json& row : g) peak = std::max(peak, row["device"]["max_active_bytes_by_category"][cat].get<size_t>());
    EXPECT_EQ(peak, est.device_memory.peak[k]) << cat;
  }
  for (const nlohmann::json& row : g) reserved = std::max(reserved, row["device"]["max_reserved_bytes"].get<size_t>());
  EXPECT_EQ(reserved, est.device_memory.peak_reserved);
  EXPECT_GT(est.device_memory.bytes(MemCategory::parameters), 0u);
  EXPECT_GT(est.device_memory.bytes(MemCategory::activations), 0u);

  // The op table's times come from the device's stamps.
  std::ifstream ops(root / "gpu" / "op_times.json");
  ASSERT_TRUE(ops.good());
  const nlohmann::json table = nlohmann::json::parse(ops);
  bool linear = false;
  for (const nlohmann::json& r : table["ops"])
    if (r["op"] == "linear.forward") linear = r["calls"].get<double>() > 0 && r["seconds"].get<double>() > 0;
  EXPECT_TRUE(linear) << table.dump(1);

  // The GPU's checkpoint of step 2 resumes on the CPU, and the CPU's on the
  // GPU: steps 3 and 4 as the uninterrupted runs had them.
  resumable_copy("gpu", "gpu-then-cpu");
  resumable_copy("cpu", "cpu-then-gpu");
  const TrainResult on_cpu = train(parse_config(args("cpu", "gpu-then-cpu", "float32")));
  const TrainResult on_gpu = train(parse_config(args("cuda", "cpu-then-gpu", "float32")));
  EXPECT_EQ(on_cpu.first_step, 3);
  EXPECT_EQ(on_gpu.first_step, 3);
  const std::vector<nlohmann::json> rc = metrics("gpu-then-cpu"), rg = metrics("cpu-then-gpu");
  ASSERT_EQ(rc.size(), 2u);
  ASSERT_EQ(rg.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    SCOPED_TRACE("step " + std::to_string(i + 3));
    EXPECT_EQ(rc[i]["step"], i + 3);
    EXPECT_LT(rel(rc[i]["loss"], c[i + 2]["loss"]), 1e-5);
    EXPECT_LT(rel(rg[i]["loss"], c[i + 2]["loss"]), 1e-5);
  }
}

TEST_F(GpuTrainOnHost, Bf16MixedPrecisionOnTheGpuAsOnTheCpu) {
  const TrainResult cpu = train(parse_config(args("cpu", "cpu-bf16", "bfloat16", 3)));
  std::vector<std::string> with_snapshot = args("cuda", "gpu-bf16", "bfloat16", 3);
  with_snapshot.push_back("--profiling.enable_memory_snapshot");
  const TrainResult gpu = train(parse_config(with_snapshot));
  const std::vector<nlohmann::json> c = metrics("cpu-bf16"), g = metrics("gpu-bf16");
  ASSERT_EQ(c.size(), 3u);
  ASSERT_EQ(g.size(), 3u);
  // bf16 products round their inputs to 8 bits of mantissa: the two paths
  // round at the same places (the per-block cast, the casts at op boundaries),
  // so their losses differ by the products' summation order only.
  for (size_t i = 0; i < 3; ++i) EXPECT_LT(rel(g[i]["loss"], c[i]["loss"]), 1e-3) << "step " << i + 1;
  EXPECT_EQ(cpu.steps_done, gpu.steps_done);
  // The memory snapshot carries the device pool's figures.
  int snapshots = 0;
  for (const auto& e : fs::recursive_directory_iterator(root / "gpu-bf16")) {
    if (e.path().string().find(".snapshot.json") == std::string::npos) continue;
    const nlohmann::json snap = nlohmann::json::parse(std::ifstream(e.path()));
    ASSERT_TRUE(snap.contains("device_pool")) << e.path();
    EXPECT_EQ(snap["device_pool"]["name"], "cuda:0");
    EXPECT_GT(snap["device_pool"]["max_reserved_bytes"].get<size_t>(), 0u);
    EXPECT_GT(snap["device_pool"]["peak_by_category"]["parameters"].get<size_t>(), 0u);
    ++snapshots;
  }
  EXPECT_GE(snapshots, 1);
}

TEST_F(GpuTrainOnHost, AJobTheGpuCannotHoldIsRefusedWithWhatWouldFit) {
  // A GPU that holds micro-batches of 4 sequences of 256 tokens, by the dry run; the job asks for 64.
  std::vector<std::string> a = args("cuda", "too-big", "float32");
  a.insert(a.end(), {"--training.seq_len", "256", "--training.local_batch_size", "4"});
  const JobConfig fits = parse_config(a);
  runtime.memory_bytes =
      estimate_layout(fits, job_model_args(fits), 1, Device::cuda(0)).ranks.front().device_memory.peak_reserved;
  a.insert(a.end(), {"--training.local_batch_size", "64"});
  try {
    train(parse_config(a));
    FAIL() << "a job over the GPU's memory trained";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("the dry run of the GPU path reserves"), std::string::npos) << msg;
    EXPECT_NE(msg.find("host-backed stand-in"), std::string::npos) << msg;
    EXPECT_NE(msg.find("What would fit, by the same dry run: "), std::string::npos) << msg;
    // (4, or 2 if accumulating needs more than one batch of 4 does)
    EXPECT_NE(msg.find(" --training.global_batch_size 64): "), std::string::npos) << msg;
  }
  EXPECT_FALSE(fs::exists(root / "too-big" / "metrics.jsonl")) << "refused before anything was written";
}

// Block-causal attention (documents split at EOS) on the GPU: the JSON
// Lines file's short documents put several in every window, so the bf16
// run's attention goes through the ragged SDPA calls and the fp32 run's
// through the row softmax's first keys. Each matches the CPU's block-causal
// run step by step, and its device peaks are the dry run's to the byte (the
// documents' pack and the token-major stats included).
TEST_F(GpuTrainOnHost, BlockCausalTrainsAsTheCpuDoesWithTheDryRunsMemory) {
  {
    std::ofstream f(root / "docs.jsonl");
    for (int i = 0; i < 300; ++i)
      f << "{\"text\": \"" << std::string(size_t(3 + (i * 7) % 19), char('a' + i % 26)) << " report " << i << "\"}\n";
  }
  const auto block_args = [&](const std::string& device, const std::string& dump, const std::string& precision) {
    std::vector<std::string> a = args(device, dump, precision, 3);
    for (size_t i = 0; i + 1 < a.size(); ++i) {
      if (a[i] == "--model.attn_mask_type") a[i + 1] = "block_causal";
      if (a[i] == "--training.dataset_path") a[i + 1] = (root / "docs.jsonl").string();
      if (a[i] == "--training.seq_len") a[i + 1] = "32";
    }
    return a;
  };
  for (const std::string precision : {"float32", "bfloat16"}) {
    SCOPED_TRACE(precision);
    const int ragged_before = kernels.ragged_calls;
    train(parse_config(block_args("cpu", "block-cpu-" + precision, precision)));
    train(parse_config(block_args("cuda", "block-gpu-" + precision, precision)));
    const std::vector<nlohmann::json> c = metrics("block-cpu-" + precision), g = metrics("block-gpu-" + precision);
    ASSERT_EQ(c.size(), 3u);
    ASSERT_EQ(g.size(), 3u);
    // fp32 as the causal run above; bf16 as Bf16MixedPrecisionOnTheGpuAsOnTheCpu.
    const double bound = precision == "float32" ? 1e-5 : 1e-3;
    for (size_t i = 0; i < 3; ++i) {
      SCOPED_TRACE("step " + std::to_string(i + 1));
      EXPECT_LT(rel(g[i]["loss"], c[i]["loss"]), bound) << g[i]["loss"] << " vs " << c[i]["loss"];
      EXPECT_LT(rel(g[i]["grad_norm"], c[i]["grad_norm"]), bound) << g[i]["grad_norm"] << " vs " << c[i]["grad_norm"];
    }
    if (precision == "bfloat16")
      EXPECT_GT(kernels.ragged_calls - ragged_before, 0) << "bf16 block-causal attention went through ragged SDPA";
    else
      EXPECT_EQ(kernels.ragged_calls - ragged_before, 0) << "fp32 attention runs the plain attention";

    const JobConfig gcfg = parse_config(block_args("cuda", "block-estimate-" + precision, precision));
    const RankEstimate est = estimate_layout(gcfg, job_model_args(gcfg), 1, Device::cuda(0)).ranks.front();
    size_t reserved = 0;
    for (int k = 0; k < kNumMemCategories; ++k) {
      const char* cat = category_name(static_cast<MemCategory>(k));
      size_t peak = 0;
      for (const nlohmann::json& row : g)
        peak = std::max(peak, row["device"]["max_active_bytes_by_category"][cat].get<size_t>());
      EXPECT_EQ(peak, est.device_memory.peak[k]) << cat;
    }
    for (const nlohmann::json& row : g) reserved = std::max(reserved, row["device"]["max_reserved_bytes"].get<size_t>());
    EXPECT_EQ(reserved, est.device_memory.peak_reserved);
  }
}

TEST_F(GpuTrainOnHost, WhatAGpuCannotRunYetIsRefusedInOneLine) {
  set_device_runtime(DeviceKind::cuda, nullptr);  // a binary without a GPU runtime
  try {
    train(parse_config(args("cuda", "none", "float32")));
    FAIL() << "job.device cuda trained without a GPU";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--job.device cpu"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace anvil
