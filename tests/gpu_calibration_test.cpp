// The GPU planner with rates measured on the user's GPU
// (estimate/gpu_calibration.h): the shapes `anvil calibrate` lists are the
// ones the estimate prices; a calibration file's timings replace the table's
// for exactly those shapes, and the estimate says so; bad files are refused
// by name; bench/gpu/calibrate.py writes a file Anvil reads (checked on the
// CPU with Debian's PyTorch: the format, not the rates).
#include <gtest/gtest.h>

#include <cstdlib>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "anvil/cli/plan_cmd.h"
#include "anvil/core/error.h"
#include "anvil/estimate/gpu_calibration.h"
#include "anvil/estimate/gpu_estimate.h"
#include "anvil/estimate/gpu_hardware.h"
#include "test_util.h"

namespace anvil {
namespace {

namespace fs = std::filesystem;

GpuRunSpec one_gpu_1b(int64_t seq) {
  GpuRunSpec s;
  s.model = model_flavor("llama3", "1B");
  s.seq_len = seq;
  s.dp_shard = 1;
  s.fsdp_single_rank = true;
  s.ac = {AcMode::none, 2};
  return s;
}

fs::path write(const std::string& name, const std::string& text) {
  const fs::path p = anvil::testing::scratch_root() / "gpu_calibration" / name;
  fs::create_directories(p.parent_path());
  std::ofstream(p) << text;
  return p;
}

// Every product and attention call priced at a calibrated time: the step's
// compute moves by exactly what the file says, and the estimate names the file.
TEST(GpuCalibration, TimedShapesArePricedByTheFile) {
  const GpuHardware& hw = gpu_hardware("h200");
  const GpuRunSpec spec = one_gpu_1b(2048);
  PricedShapes priced;
  const GpuStepEstimate table = estimate_gpu_run(spec, hw, nullptr, &priced);
  ASSERT_GE(priced.gemms.size(), 7u);  // wq, wk/wv, wo, w1/w3, w2, the head: forward and both gradients
  ASSERT_EQ(priced.attention.size(), 1u);
  EXPECT_NE(table.rate_sources.find("no calibration file"), std::string::npos) << table.rate_sources;

  // The file: each product twice as slow as 1 ns per 1e6 FLOPs would make it, attention fixed.
  nlohmann::json j;
  j["device"] = "test";
  for (const auto& [key, g] : priced.gemms)
    j["gemms"].push_back({{"m", g.m}, {"k", g.k}, {"n", g.n}, {"seconds", 2 * g.m * g.k * g.n / 1e15}});
  for (const auto& [key, a] : priced.attention)
    j["attention"].push_back({{"batch", a.batch},
                              {"queries", a.queries},
                              {"keys", a.keys},
                              {"heads", a.heads},
                              {"head_dim", a.head_dim},
                              {"forward_seconds", 1e-3},
                              {"backward_seconds", 2.5e-3}});
  const GpuCalibration cal = GpuCalibration::load(write("all.json", j.dump()).string());
  const GpuStepEstimate measured = estimate_gpu_run(spec, hw, &cal);
  EXPECT_NE(measured.rate_sources.find("calibration "), std::string::npos) << measured.rate_sources;
  EXPECT_NE(measured.rate_sources.find("test"), std::string::npos) << measured.rate_sources;
  const std::string all_timed = std::to_string(priced.gemms.size());
  EXPECT_NE(measured.rate_sources.find(all_timed + " of " + all_timed + " matrix-product shapes"), std::string::npos)
      << measured.rate_sources;
  EXPECT_NE(measured.rate_sources.find("1 of 1 attention shapes"), std::string::npos) << measured.rate_sources;

  // Only the products and attention changed: the compute difference is theirs.
  const ModelArgs& a = spec.model;
  const double T = 2048, D = a.dim, Dq = a.n_heads * a.head_dim(), Dkv = a.n_kv_heads * a.head_dim(),
               F = a.ffn_hidden_dim(), V = a.vocab_size, L = a.n_layers;
  const double block_flops = 2 * T * D * (Dq + 2 * Dkv) + 2 * T * Dq * D + 3 * 2 * T * D * F;
  const double want_products = 3 * (L * block_flops + 2 * T * D * V) / 1e15;  // forward, dX, dW
  const double want_attention = L * (1e-3 + 2.5e-3);
  GpuCalibration only_general;  // no shapes: the same estimate as the table's
  const GpuStepEstimate same = estimate_gpu_run(spec, hw, &only_general);
  EXPECT_DOUBLE_EQ(same.compute_seconds, table.compute_seconds);
  // The table's products and attention, from its own pricing of the same shapes.
  GpuCalibration zero = cal;
  for (auto& [key, secs] : zero.gemm_seconds) secs = 1e-30;
  for (auto& [key, secs] : zero.attention_seconds) secs = {1e-30, 1e-30};
  const GpuStepEstimate rest = estimate_gpu_run(spec, hw, &zero);
  EXPECT_NEAR(measured.compute_seconds - rest.compute_seconds, want_products + want_attention, 1e-9);
  std::printf("1B seq 2048 on one H200: compute %.4f s by the table, %.4f s with the test calibration\n",
              table.compute_seconds, measured.compute_seconds);
}

TEST(GpuCalibration, BadFilesAreRefusedByName) {
  const auto refused = [](const std::string& text, const std::string& want) {
    const fs::path p = write("bad.json", text);
    const std::string msg = anvil::testing::error_of([&] { GpuCalibration::load(p.string()); });
    EXPECT_NE(msg.find(want), std::string::npos) << "for " << text << ": " << msg;
    EXPECT_NE(msg.find(p.string()), std::string::npos) << msg;
  };
  refused("{", "is not JSON");
  refused("[1]", "holds no JSON object");
  refused(R"({"matmul_flops": -3})", "\"matmul_flops\" must be a positive number");
  refused(R"({"gemms": [{"m": 1, "k": 2, "seconds": 1}]})", "gemms[0] has no \"n\"");
  refused(R"({"attention": {}})", "\"attention\" must be an array");
  const std::string missing = anvil::testing::error_of([] { GpuCalibration::load("/nonexistent/cal.json"); });
  EXPECT_NE(missing.find("bench/gpu/calibrate.py"), std::string::npos) << missing;
}

// anvil calibrate writes the shapes; bench/gpu/calibrate.py times them (here
// on the CPU, with small square GEMMs and Debian's PyTorch) into a file that
// anvil estimate reads and names.
TEST(GpuCalibration, TheScriptWritesAFileTheEstimateReads) {
  if (std::system("/usr/bin/python3 -c 'import torch' > /dev/null 2>&1") != 0) {
    const char* why = "Debian's PyTorch (python3-torch) is not installed: scripts/setup.sh installs it";
    const char* ci = std::getenv("CI");  // where the set-up must provide the oracle, its absence fails
    if (ci != nullptr && *ci != '\0') FAIL() << why << ". CI=" << ci << " is set, and there the set-up must provide it.";
    GTEST_SKIP() << why;
  }
  const fs::path dir = anvil::testing::scratch_root() / "gpu_calibration";
  fs::create_directories(dir);
  const std::string cfg = std::string(ANVIL_SOURCE_DIR) + "/configs/debugmodel.toml";
  const std::string run = " --hardware h100-80g --gpus 1 --training.seq_len 128 --training.local_batch_size 2";
  const auto shapes = anvil::testing::run_anvil("calibrate " + cfg + run + " --shapes " + (dir / "shapes.json").string());
  ASSERT_EQ(shapes.exit_code, 0) << shapes.text;
  const std::string script = std::string("/usr/bin/python3 ") + ANVIL_SOURCE_DIR +
                             "/bench/gpu/calibrate.py --device cpu --runs 2 --shapes " + (dir / "shapes.json").string() +
                             " --output " + (dir / "cal.json").string() + " > " + (dir / "script.log").string() +
                             " 2>&1";
  ASSERT_EQ(std::system(script.c_str()), 0) << script;
  const auto est =
      anvil::testing::run_anvil("estimate " + cfg + run + " --calibration " + (dir / "cal.json").string() + " --json");
  ASSERT_EQ(est.exit_code, 0) << est.text;
  const nlohmann::json j = nlohmann::json::parse(est.text);
  const std::string rates = j.at("rates").get<std::string>();
  EXPECT_NE(rates.find("cpu (a check of calibrate.py"), std::string::npos) << rates;
  const nlohmann::json listed = nlohmann::json::parse(std::ifstream(dir / "shapes.json"));
  const std::string n = std::to_string(listed.at("gemms").size());
  EXPECT_NE(rates.find(n + " of " + n + " matrix-product shapes"), std::string::npos) << rates;
  EXPECT_NE(rates.find("1 of 1 attention shapes"), std::string::npos) << rates;
  EXPECT_NE(rates.find("eager host costs 3 of 8 from the calibration"), std::string::npos) << rates;  // on a CPU: no FSDP2
}

}  // namespace
}  // namespace anvil
