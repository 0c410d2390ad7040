// Checkpoints end to end through the anvil program: an interrupted and resumed
// run equals an uninterrupted one bit for bit; damaged or mismatching
// checkpoints are refused with the file and the reason.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include "test_util.h"

namespace fs = std::filesystem;

namespace {

using Output = anvil::testing::CommandOutput;
Output run(const std::string& args, const std::string& prefix = "") { return anvil::testing::run_anvil(args, prefix); }

fs::path workdir(const std::string& name) {
  const fs::path dir = anvil::testing::scratch_root() / ("anvil_checkpoint_test_" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream text(dir / "text.txt");
  for (int i = 0; i < 300; ++i)
    text << "Line " << i % 13 << ": the jury said the election was well conducted, and the city thanked it.\n";
  return dir;
}

// A constant learning rate after warm-up (decay_ratio 0), so a run to step 10 and
// a run to step 20 see the same schedule up to step 10.
std::string args(const fs::path& dir, const std::string& dtype) {
  return "train --training.dataset text --training.dataset_path " + (dir / "text.txt").string() +
         " --training.seq_len 32 --training.local_batch_size 2 --metrics.log_freq 1"
         " --lr_scheduler.warmup_steps 3 --lr_scheduler.decay_ratio 0 --training.mixed_precision_param " + dtype;
}

std::vector<std::string> losses(const fs::path& metrics) {
  std::vector<std::string> out;
  std::ifstream in(metrics);
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line)["loss"].dump());
  return out;
}

}  // namespace

TEST(Checkpoint, ResumedRunEqualsUninterruptedRunBitForBit) {
  for (const std::string dtype : {"float32", "bfloat16"}) {
    SCOPED_TRACE(dtype);
    const fs::path dir = workdir("resume_" + dtype);
    const std::string common = args(dir, dtype);
    Output whole = run(common + " --training.steps 20 --job.dump_folder " + (dir / "whole").string());
    ASSERT_EQ(whole.exit_code, 0) << whole.text;
    const std::string ck = " --checkpoint.enable --checkpoint.interval 5 --job.dump_folder " + (dir / "split").string();
    Output first = run(common + " --training.steps 10" + ck);
    ASSERT_EQ(first.exit_code, 0) << first.text;
    Output second = run(common + " --training.steps 20" + ck);
    ASSERT_EQ(second.exit_code, 0) << second.text;
    EXPECT_NE(second.text.find("resumed from"), std::string::npos) << second.text;
    const auto a = losses(dir / "whole" / "metrics.jsonl"), b = losses(dir / "split" / "metrics.jsonl");
    ASSERT_EQ(a.size(), 20u);
    ASSERT_EQ(b.size(), 20u);
    for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i], b[i]) << "step " << i + 1;  // the printed doubles, exactly
  }
}

TEST(Checkpoint, CorruptOrMismatchingCheckpointsAreRefused) {
  const fs::path dir = workdir("faults");
  const std::string ck = " --checkpoint.enable --checkpoint.interval 2 --job.dump_folder " + (dir / "run").string();
  Output out = run(args(dir, "float32") + " --training.steps 2" + ck);
  ASSERT_EQ(out.exit_code, 0) << out.text;
  const fs::path model = dir / "run" / "checkpoint" / "step-2" / "model.safetensors";
  ASSERT_TRUE(fs::exists(model));
  // A checkpoint of another model shape: the first mismatching tensor is named.
  out = run(args(dir, "float32") + " --training.steps 4 --model.flavor 25M" + ck);
  EXPECT_EQ(out.exit_code, 1) << out.text;
  EXPECT_NE(out.text.find("model.embed_tokens.weight"), std::string::npos) << out.text;
  EXPECT_NE(out.text.find("different model shape"), std::string::npos) << out.text;
  // One flipped byte: the file and the reason.
  {
    std::fstream f(model, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-100, std::ios::end);
    char c;
    f.get(c);
    f.seekp(-100, std::ios::end);
    f.put(static_cast<char>(c ^ 0x10));
  }
  out = run(args(dir, "float32") + " --training.steps 4" + ck);
  EXPECT_EQ(out.exit_code, 1) << out.text;
  EXPECT_NE(out.text.find("model.safetensors' is corrupt: CRC32"), std::string::npos) << out.text;
}

TEST(Checkpoint, AnUnfinishedSaveIsNeverLoaded) {
  // A save killed before its rename leaves step-N.tmp behind: it is ignored and
  // the previous checkpoint is used.
  const fs::path dir = workdir("unfinished");
  const std::string ck = " --checkpoint.enable --checkpoint.interval 2 --job.dump_folder " + (dir / "run").string();
  Output out = run(args(dir, "float32") + " --training.steps 2" + ck);
  ASSERT_EQ(out.exit_code, 0) << out.text;
  const fs::path folder = dir / "run" / "checkpoint";
  fs::copy(folder / "step-2", folder / "step-4.tmp", fs::copy_options::recursive);
  std::ofstream(folder / "step-4.tmp" / "model.safetensors", std::ios::trunc) << "half a file";
  out = run(args(dir, "float32") + " --training.steps 3" + ck);
  EXPECT_EQ(out.exit_code, 0) << out.text;
  EXPECT_NE(out.text.find("resumed from " + (folder / "step-2").string()), std::string::npos) << out.text;
}
