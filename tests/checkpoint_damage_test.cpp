// A damaged checkpoint never restarts a run quietly: every kind of damage to
// each file of the newest step stops the run before anything is written,
// naming the file, what is wrong and the keys that resume from an older step;
// stepping back past newer folders needs checkpoint.overwrite_newer, which
// moves them aside; retention deletes only complete, older steps.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>

#include "test_util.h"

namespace fs = std::filesystem;

namespace {

using Output = anvil::testing::CommandOutput;
using anvil::testing::losses_by_step;
Output run(const std::string& args) { return anvil::testing::run_anvil(args); }

struct Job {
  fs::path dir, dump, folder;
  std::string args;  // without training.steps
};

// A 4-step run saving every 2 steps: step-2 and step-4, both complete.
Job trained_job(const std::string& name) {
  Job j;
  j.dir = anvil::testing::scratch_root() / ("anvil_checkpoint_damage_" + name);
  fs::remove_all(j.dir);
  fs::create_directories(j.dir);
  {
    std::ofstream text(j.dir / "text.txt");
    for (int i = 0; i < 300; ++i) text << "Line " << i % 11 << ": the cat sat on the mat and looked at the door.\n";
  }
  j.dump = j.dir / "run";
  j.folder = j.dump / "checkpoint";
  j.args = "train --training.dataset text --training.dataset_path " + (j.dir / "text.txt").string() +
           " --training.seq_len 32 --training.local_batch_size 2 --metrics.log_freq 1 --lr_scheduler.warmup_steps 2"
           " --lr_scheduler.decay_ratio 0 --training.mixed_precision_param float32 --checkpoint.enable"
           " --checkpoint.interval 2 --job.dump_folder " + j.dump.string();
  const Output out = run(j.args + " --training.steps 4");
  EXPECT_EQ(out.exit_code, 0) << out.text;
  return j;
}

std::string bytes_of(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// Every entry under `root` and the bytes of every file: what "unchanged" means.
std::map<std::string, std::string> snapshot(const fs::path& root) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(root))
    out[fs::relative(e.path(), root).string()] = e.is_regular_file() ? bytes_of(e.path()) : "<dir>";
  return out;
}

enum class Damage { truncated, deleted, flipped };

// Deletes, halves, or flips one bit: of the middle byte, or in state.json of
// the first non-leading digit from the middle on (so it still parses, and
// only the self-checksum can catch it).
void damage(const fs::path& file, Damage d) {
  if (d == Damage::deleted) {
    fs::remove(file);
    return;
  }
  std::string bytes = bytes_of(file);
  if (d == Damage::truncated) {
    fs::resize_file(file, bytes.size() / 2);
    return;
  }
  size_t at = bytes.size() / 2;
  // A digit after a digit: flipping it keeps the number valid JSON (a leading 0 would not be).
  auto digit = [&](size_t i) { return bytes[i] >= '0' && bytes[i] <= '9'; };
  if (file.filename() == "state.json")
    while (at < bytes.size() && !(digit(at) && digit(at - 1))) ++at;
  ASSERT_LT(at, bytes.size());
  bytes[at] = static_cast<char>(bytes[at] ^ 0x01);
  std::ofstream(file, std::ios::binary | std::ios::trunc) << bytes;
}

// What the refusal must say of each kind of damage to each file.
std::string expected_problem(const std::string& file, Damage d) {
  if (d == Damage::deleted) return file + "' is missing";
  if (file == "state.json")
    return d == Damage::truncated ? "state.json' is not valid JSON" : "state.json' is corrupt: its content has CRC32";
  return d == Damage::truncated ? "(truncated)" : file + "' is corrupt: CRC32";
}

}  // namespace

TEST(CheckpointDamage, EveryDamageToTheNewestStepStopsTheRunAndChangesNothingOnDisk) {
  const Job job = trained_job("kinds");
  const fs::path pristine = job.dir / "pristine";
  fs::copy(job.folder, pristine, fs::copy_options::recursive);
  const fs::path step4 = job.folder / "step-4";
  for (const std::string file : {"model.safetensors", "optimizer.safetensors", "config.toml", "state.json"}) {
    for (const Damage d : {Damage::truncated, Damage::deleted, Damage::flipped}) {
      SCOPED_TRACE(file + " " + std::to_string(static_cast<int>(d)));
      fs::remove_all(job.folder);
      fs::copy(pristine, job.folder, fs::copy_options::recursive);
      damage(step4 / file, d);
      const auto before = snapshot(job.folder);
      const Output out = run(job.args + " --training.steps 6");
      EXPECT_EQ(out.exit_code, 1) << out.text;
      EXPECT_NE(out.text.find((step4 / file).string()), std::string::npos) << out.text;
      EXPECT_NE(out.text.find(expected_problem(file, d)), std::string::npos) << out.text;
      EXPECT_NE(out.text.find("To resume from step-2, the newest complete step before it, run again with "
                              "--checkpoint.load_step 2 --checkpoint.overwrite_newer true"),
                std::string::npos)
          << out.text;
      EXPECT_EQ(out.text.find("resumed from"), std::string::npos) << out.text;
      EXPECT_EQ(snapshot(job.folder), before) << "the refused run changed the checkpoint folder";
    }
  }
}

TEST(CheckpointDamage, SteppingBackPastNewerFoldersNeedsOverwriteNewerWhichMovesThemAside) {
  const Job job = trained_job("step_back");
  const auto whole = losses_by_step(job.dump / "metrics.jsonl");
  ASSERT_EQ(whole.size(), 4u);
  // A complete newer step: resuming from step 2 is refused, nothing changes.
  auto before = snapshot(job.folder);
  Output out = run(job.args + " --training.steps 4 --checkpoint.load_step 2");
  EXPECT_EQ(out.exit_code, 1) << out.text;
  EXPECT_NE(out.text.find("holds newer step folders (step-4 (complete)); resuming from step 2 would retrain those "
                          "steps and write over them. Run again with --checkpoint.overwrite_newer true"),
            std::string::npos)
      << out.text;
  EXPECT_EQ(snapshot(job.folder), before);
  // A damaged newest step, stepped back past by the keys the refusal names:
  // step-4 is renamed aside byte for byte, and steps 3-4 are retrained exactly.
  damage(job.folder / "step-4" / "state.json", Damage::flipped);
  const std::string damaged_state = bytes_of(job.folder / "step-4" / "state.json");
  out = run(job.args + " --training.steps 4 --checkpoint.load_step 2 --checkpoint.overwrite_newer true");
  ASSERT_EQ(out.exit_code, 0) << out.text;
  EXPECT_NE(out.text.find("resumed from " + (job.folder / "step-2").string()), std::string::npos) << out.text;
  EXPECT_NE(out.text.find("moved " + (job.folder / "step-4").string() + " aside to step-4.damaged-"),
            std::string::npos)
      << out.text;
  int set_aside = 0;
  for (const auto& e : fs::directory_iterator(job.folder)) {
    if (e.path().filename().string().rfind("step-4.damaged-", 0) != 0) continue;
    ++set_aside;
    EXPECT_EQ(bytes_of(e.path() / "state.json"), damaged_state);
  }
  EXPECT_EQ(set_aside, 1);
  EXPECT_TRUE(fs::exists(job.folder / "step-4" / "state.json")) << "the retrained step 4 is saved anew";
  EXPECT_EQ(losses_by_step(job.dump / "metrics.jsonl"), whole);
  // A checkpoint of the earlier format (no self-checksum line) still resumes.
  const fs::path state4 = job.folder / "step-4" / "state.json";
  std::string text = bytes_of(state4);
  text = "{\n" + text.substr(text.find('\n', 2) + 1);
  const size_t v = text.find("\"format_version\": 2");
  ASSERT_NE(v, std::string::npos) << text;
  text.replace(v, 19, "\"format_version\": 1");
  std::ofstream(state4, std::ios::trunc) << text;
  out = run(job.args + " --training.steps 6");
  ASSERT_EQ(out.exit_code, 0) << out.text;
  EXPECT_NE(out.text.find("resumed from " + (job.folder / "step-4").string()), std::string::npos) << out.text;
}

TEST(CheckpointDamage, RetentionDeletesOnlyCompleteOlderSteps) {
  const Job job = trained_job("retention");
  fs::remove(job.folder / "step-2" / "optimizer.safetensors");  // an older step, damaged
  const Output out = run(job.args + " --training.steps 8 --checkpoint.keep_latest_k 2");
  ASSERT_EQ(out.exit_code, 0) << out.text;
  EXPECT_NE(out.text.find("resumed from " + (job.folder / "step-4").string()), std::string::npos) << out.text;
  EXPECT_TRUE(fs::exists(job.folder / "step-2" / "model.safetensors")) << "a damaged folder is never deleted";
  EXPECT_FALSE(fs::exists(job.folder / "step-4")) << "the oldest complete step beyond keep_latest_k goes";
  EXPECT_TRUE(fs::exists(job.folder / "step-6" / "state.json"));
  EXPECT_TRUE(fs::exists(job.folder / "step-8" / "state.json"));
}
