// Checkpoints end to end through the anvil program: an interrupted and resumed
// run equals an uninterrupted one bit for bit; damaged or mismatching
// checkpoints are refused with the file and the reason.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
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

// A run of `steps` steps in dir/whole, and the same run stopped at steps / 2
// and resumed in dir/split (saving every `interval` steps): the two log the
// same losses, the printed doubles exactly. Returns the split run's
// checkpoint flags.
std::string expect_resumed_run_equals_whole(const fs::path& dir, const std::string& common, int steps, int interval) {
  Output whole = run(common + " --training.steps " + std::to_string(steps) + " --job.dump_folder " +
                     (dir / "whole").string());
  EXPECT_EQ(whole.exit_code, 0) << whole.text;
  const std::string ck = " --checkpoint.enable --checkpoint.interval " + std::to_string(interval) +
                         " --job.dump_folder " + (dir / "split").string();
  Output first = run(common + " --training.steps " + std::to_string(steps / 2) + ck);
  EXPECT_EQ(first.exit_code, 0) << first.text;
  Output second = run(common + " --training.steps " + std::to_string(steps) + ck);
  EXPECT_EQ(second.exit_code, 0) << second.text;
  EXPECT_NE(second.text.find("resumed from"), std::string::npos) << second.text;
  const auto a = losses(dir / "whole" / "metrics.jsonl"), b = losses(dir / "split" / "metrics.jsonl");
  EXPECT_EQ(a.size(), static_cast<size_t>(steps));
  EXPECT_EQ(b.size(), static_cast<size_t>(steps));
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) EXPECT_EQ(a[i], b[i]) << "step " << i + 1;
  return ck;
}

}  // namespace

TEST(Checkpoint, ResumedRunEqualsUninterruptedRunBitForBit) {
  for (const std::string dtype : {"float32", "bfloat16"}) {
    SCOPED_TRACE(dtype);
    const fs::path dir = workdir("resume_" + dtype);
    expect_resumed_run_equals_whole(dir, args(dir, dtype), 20, 5);
  }
}

// Muon's momentum and its AdamW groups' moments come back exactly; a resume
// under the other optimizer is refused, saying how to go on.
TEST(Checkpoint, AMuonRunResumesBitForBitAndRefusesToResumeUnderAdamW) {
  const fs::path dir = workdir("muon");
  const std::string ck =
      expect_resumed_run_equals_whole(dir, args(dir, "bfloat16") + " --optimizer.name Muon", 8, 4);
  Output adamw = run(args(dir, "bfloat16") + " --training.steps 12" + ck);
  EXPECT_EQ(adamw.exit_code, 1) << adamw.text;
  EXPECT_NE(adamw.text.find("holds the state of optimizer.name = \"Muon\", and this run sets \"AdamW\"; a run "
                            "cannot change its optimizer on resume"),
            std::string::npos)
      << adamw.text;
}

TEST(Checkpoint, CorruptOrMismatchingCheckpointsAreRefused) {
  const fs::path dir = workdir("faults");
  const std::string ck = " --checkpoint.enable --checkpoint.interval 2 --job.dump_folder " + (dir / "run").string();
  Output out = run(args(dir, "float32") + " --training.steps 2" + ck);
  ASSERT_EQ(out.exit_code, 0) << out.text;
  const fs::path model = dir / "run" / "checkpoint" / "step-2" / "model.safetensors";
  ASSERT_TRUE(fs::exists(model));
  // A checkpoint of another model: the flavour it recorded and the keys that resume it.
  out = run(args(dir, "float32") + " --training.steps 4 --model.flavor 25M" + ck);
  EXPECT_EQ(out.exit_code, 1) << out.text;
  EXPECT_NE(out.text.find("holds a llama3/debugmodel model but this run trains llama3/25M"), std::string::npos)
      << out.text;
  EXPECT_NE(out.text.find("--model.name llama3 --model.flavor debugmodel"), std::string::npos) << out.text;
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
  EXPECT_NE(out.text.find("No complete step precedes it. To start afresh, run again with "
                          "--checkpoint.overwrite_newer true"),
            std::string::npos)
      << out.text;
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

using anvil::testing::losses_by_step;

TEST(Checkpoint, AsyncSavesResumeExactlyLikeUninterruptedRuns) {
  const fs::path dir = workdir("async");
  const std::string common = args(dir, "bfloat16");
  Output whole = run(common + " --training.steps 20 --job.dump_folder " + (dir / "whole").string());
  ASSERT_EQ(whole.exit_code, 0) << whole.text;
  const std::string ck = " --checkpoint.enable --checkpoint.interval 3 --checkpoint.async_mode async --job.dump_folder " +
                         (dir / "split").string();
  Output first = run(common + " --training.steps 10" + ck);
  ASSERT_EQ(first.exit_code, 0) << first.text;
  EXPECT_NE(first.text.find("in the background"), std::string::npos) << first.text;
  Output second = run(common + " --training.steps 20" + ck);
  ASSERT_EQ(second.exit_code, 0) << second.text;
  EXPECT_NE(second.text.find("resumed from " + (dir / "split" / "checkpoint" / "step-10").string()), std::string::npos)
      << second.text;
  const auto a = losses_by_step(dir / "whole" / "metrics.jsonl"), b = losses_by_step(dir / "split" / "metrics.jsonl");
  ASSERT_EQ(a.size(), 20u);
  EXPECT_EQ(a, b);
}

TEST(Checkpoint, SigkillDuringASaveKeepsThePreviousCheckpoint) {
  const fs::path dir = workdir("sigkill");
  const std::string common = args(dir, "float32");
  Output whole = run(common + " --training.steps 14 --job.dump_folder " + (dir / "whole").string());
  ASSERT_EQ(whole.exit_code, 0) << whole.text;
  const fs::path folder = dir / "split" / "checkpoint";
  const std::string ck = " --checkpoint.enable --checkpoint.interval 5 --job.dump_folder " + (dir / "split").string();
  // The process SIGKILLs itself halfway through writing step 10's weights.
  Output killed = run(common + " --training.steps 14" + ck, "ANVIL_FAULT_KILL_DURING_SAVE=10 ");
  EXPECT_NE(killed.exit_code, 0) << killed.text;
  EXPECT_EQ(killed.text.find("anvil: done"), std::string::npos) << killed.text;
  EXPECT_TRUE(fs::exists(folder / "step-5" / "state.json"));
  EXPECT_TRUE(fs::exists(folder / "step-10.tmp")) << "the kill should have caught the save in the middle";
  EXPECT_FALSE(fs::exists(folder / "step-10"));
  // The next run resumes from step 5 and ends where the uninterrupted run did.
  Output resumed = run(common + " --training.steps 14" + ck);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.text;
  EXPECT_NE(resumed.text.find("resumed from " + (folder / "step-5").string()), std::string::npos) << resumed.text;
  EXPECT_EQ(losses_by_step(dir / "whole" / "metrics.jsonl"), losses_by_step(dir / "split" / "metrics.jsonl"));
  EXPECT_TRUE(fs::exists(folder / "step-14" / "state.json"));
  EXPECT_FALSE(fs::exists(folder / "step-10.tmp")) << "the next save of step 10 replaced the unfinished one";
}

TEST(Checkpoint, AFullDiskFailsTheSaveClearlyAndKeepsThePreviousCheckpoint) {
  const fs::path dir = workdir("full_disk");
  const fs::path disk = dir / "disk";
  fs::create_directories(disk);
  // A small tmpfs gives a real "No space left on device"; where mounting is not
  // allowed (not root), a file-size limit (ulimit -f) makes the large write fail.
  const bool tmpfs = std::system(("mount -t tmpfs -o size=100m tmpfs " + disk.string() + " 2>/dev/null").c_str()) == 0;
  struct Unmount {
    bool on;
    fs::path path;
    ~Unmount() {
      if (on) (void)std::system(("umount " + path.string()).c_str());
    }
  } unmount{tmpfs, disk};
  std::printf("full disk simulated with %s\n", tmpfs ? "a 100 MiB tmpfs" : "ulimit -f 30000 (KiB)");
  // debugmodel: 6.2M parameters, so a checkpoint is 24.7 MB of weights and 49.3 MB of
  // AdamW moments: one fits in 100 MiB, a second does not.
  const std::string common = "train --training.dataset text --training.dataset_path " + (dir / "text.txt").string() +
                             " --training.seq_len 32 --training.local_batch_size 2 --metrics.log_freq 1"
                             " --training.mixed_precision_param float32 --checkpoint.enable --checkpoint.interval 5"
                             " --job.dump_folder " + (disk / "run").string();
  const fs::path folder = disk / "run" / "checkpoint";
  Output first = run(common + " --training.steps 5");
  ASSERT_EQ(first.exit_code, 0) << first.text;
  const std::string limit = tmpfs ? "" : "ulimit -f 30000; ";
  Output failed = run(common + " --training.steps 10", limit);
  EXPECT_EQ(failed.exit_code, 1) << failed.text;
  EXPECT_NE(failed.text.find("saving checkpoint step 10 failed"), std::string::npos) << failed.text;
  EXPECT_NE(failed.text.find(tmpfs ? "No space left on device" : "File too large"), std::string::npos) << failed.text;
  EXPECT_NE(failed.text.find("the previous checkpoint " + (folder / "step-5").string() + " is intact"),
            std::string::npos)
      << failed.text;
  EXPECT_FALSE(fs::exists(folder / "step-10.tmp")) << "the unfinished save is removed, freeing its space";
  EXPECT_FALSE(fs::exists(folder / "step-10"));
  // Once there is room again, the run resumes from step 5.
  if (tmpfs) {
    ASSERT_EQ(std::system(("mount -o remount,size=400m " + disk.string()).c_str()), 0);
  }
  Output resumed = run(common + " --training.steps 10");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.text;
  EXPECT_NE(resumed.text.find("resumed from " + (folder / "step-5").string()), std::string::npos) << resumed.text;
  EXPECT_TRUE(fs::exists(folder / "step-10" / "state.json"));
}

TEST(Checkpoint, AModelOnlyLastSaveStartsANewRunButIsNotResumed) {
  const fs::path dir = workdir("model_only");
  const std::string common = args(dir, "bfloat16");
  const std::string ck = " --checkpoint.enable --checkpoint.interval 4 --checkpoint.last_save_model_only"
                         " --checkpoint.export_dtype bfloat16 --job.dump_folder " + (dir / "a").string();
  Output out = run(common + " --training.steps 6" + ck);
  ASSERT_EQ(out.exit_code, 0) << out.text;
  const fs::path last = dir / "a" / "checkpoint" / "step-6";
  EXPECT_NE(out.text.find("model only"), std::string::npos) << out.text;
  EXPECT_TRUE(fs::exists(last / "model.safetensors"));
  EXPECT_FALSE(fs::exists(last / "optimizer.safetensors"));
  std::ifstream in(last / "state.json");
  const nlohmann::json state = nlohmann::json::parse(in);
  EXPECT_EQ(state["model_dtype"], "bf16");
  EXPECT_TRUE(state["model_only"].get<bool>());
  // bf16 weights: half the bytes of the fp32 ones in step-4.
  EXPECT_LT(fs::file_size(last / "model.safetensors") * 10,
            fs::file_size(dir / "a" / "checkpoint" / "step-4" / "model.safetensors") * 6);
  // Rerunning the job would retrain from step 4 and write over the model-only
  // step 6: refused, naming both ways on; with overwrite_newer it resumes from
  // step 4 and moves step 6 aside.
  out = run(common + " --training.steps 6" + ck);
  EXPECT_EQ(out.exit_code, 1) << out.text;
  EXPECT_NE(out.text.find("holds only the model weights (checkpoint.last_save_model_only), so training cannot "
                          "continue from it. To continue from step-4"),
            std::string::npos)
      << out.text;
  EXPECT_NE(out.text.find("--checkpoint.load_step 4 --checkpoint.overwrite_newer true"), std::string::npos) << out.text;
  EXPECT_NE(out.text.find("--checkpoint.initial_load_path " + last.string()), std::string::npos) << out.text;
  EXPECT_TRUE(fs::exists(last / "state.json"));
  // Asking for the model-only step says why not.
  out = run(common + " --training.steps 8 --checkpoint.load_step 6" + ck);
  EXPECT_EQ(out.exit_code, 1) << out.text;
  EXPECT_NE(out.text.find("it cannot be resumed from. Use it as checkpoint.initial_load_path"), std::string::npos)
      << out.text;
  // A new run starts from its weights: its first loss is the loss those weights
  // give, far below a fresh initialisation's.
  out = run(common + " --training.steps 1 --checkpoint.initial_load_path " + last.string() +
            " --job.dump_folder " + (dir / "b").string());
  ASSERT_EQ(out.exit_code, 0) << out.text;
  EXPECT_NE(out.text.find("model weights from " + last.string()), std::string::npos) << out.text;
  const auto fresh = losses_by_step(dir / "a" / "metrics.jsonl");
  const auto started = losses_by_step(dir / "b" / "metrics.jsonl");
  ASSERT_EQ(started.size(), 1u);
  EXPECT_LT(std::stod(started.at(1)), std::stod(fresh.at(1)) - 0.05) << "fresh " << fresh.at(1);
  // The same weights through a Hugging Face folder give the same first loss, bit for bit.
  out = run("convert export " + last.string() + " " + (dir / "hf").string());
  ASSERT_EQ(out.exit_code, 0) << out.text;
  out = run(common + " --training.steps 1 --checkpoint.initial_load_path " + (dir / "hf").string() +
            " --job.dump_folder " + (dir / "from_hf").string());
  ASSERT_EQ(out.exit_code, 0) << out.text;
  EXPECT_EQ(losses_by_step(dir / "from_hf" / "metrics.jsonl"), started);
  out = run(common + " --training.steps 1 --checkpoint.initial_load_path " + (dir / "nowhere").string() +
            " --job.dump_folder " + (dir / "c").string());
  EXPECT_EQ(out.exit_code, 1);
  EXPECT_NE(out.text.find("is not a folder"), std::string::npos) << out.text;
}
