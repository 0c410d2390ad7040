// End to end: the anvil program trains on a small text, logs its metrics,
// stops cleanly on Ctrl-C, and explains bad input in one line.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include "anvil/data/brown.h"
#include "test_util.h"

namespace fs = std::filesystem;

namespace {

using Output = anvil::testing::CommandOutput;
Output run(const std::string& args, const std::string& prefix = "") { return anvil::testing::run_anvil(args, prefix); }

// A small, repetitive English text, generated.
fs::path make_dataset() {
  const fs::path dir = anvil::testing::scratch_root() / "anvil_train_test";
  fs::create_directories(dir);
  std::ofstream f(dir / "text.txt");
  for (int i = 0; i < 400; ++i)
    f << "The jury said the election was conducted well, and the city thanked them for it. "
      << "Number " << i % 17 << " of the reports praised the manner of the work.\n";
  return dir / "text.txt";
}

std::string common_args(const fs::path& data, const fs::path& dump) {
  return "--training.dataset text --training.dataset_path " + data.string() +
         " --training.seq_len 64 --training.local_batch_size 4 --metrics.log_freq 5 --lr_scheduler.warmup_steps 5"
         " --optimizer.lr 3e-3 --job.dump_folder " + dump.string();
}

}  // namespace

TEST(Train, LossFallsAndMetricsAreLogged) {
  const fs::path data = make_dataset(), dump = anvil::testing::scratch_root() / "anvil_train_test_out";
  fs::remove_all(dump);
  const Output out = run("train " + common_args(data, dump) +
                         " --training.steps 30 --training.global_batch_size 8 --activation_checkpoint.mode full");
  ASSERT_EQ(out.exit_code, 0) << out.text;
  EXPECT_NE(out.text.find("6,163,712 parameters"), std::string::npos) << out.text;
  EXPECT_NE(out.text.find("2 micro-batches of 4 x 64 tokens per step"), std::string::npos) << out.text;
  std::ifstream jsonl(dump / "metrics.jsonl");
  std::vector<nlohmann::json> rows;
  for (std::string line; std::getline(jsonl, line);) rows.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(rows.size(), 6u);
  for (const char* key : {"step", "loss", "grad_norm", "lr", "tokens_per_s", "tflops", "mfu_pct", "max_active_bytes",
                          "max_active_bytes_by_category", "data_loading_pct", "elapsed_s"})
    EXPECT_TRUE(rows[0].contains(key)) << key;
  EXPECT_GT(rows[0]["max_active_bytes_by_category"]["activations"].get<double>(), 0);
  const double first = rows.front()["loss"], last = rows.back()["loss"];
  std::printf("loss %.3f -> %.3f\n", first, last);
  EXPECT_LT(last, first - 1.0);  // a repetitive text is learnt fast
}

TEST(Train, NonFiniteLossStopsWithTheStepOrIsSkipped) {
  const fs::path data = make_dataset(), dump = anvil::testing::scratch_root() / "anvil_train_test_nan";
  // An absurd learning rate blows the weights up after the first update.
  const std::string args = "train " + common_args(data, dump) +
                           " --training.steps 6 --optimizer.lr 1e30 --lr_scheduler.warmup_steps 0 --training.max_norm 0";
  const Output stop = run(args);
  EXPECT_EQ(stop.exit_code, 1) << stop.text;
  EXPECT_NE(stop.text.find("is not finite"), std::string::npos) << stop.text;
  EXPECT_NE(stop.text.find("anvil: error: step "), std::string::npos) << stop.text;
  const Output skip = run(args + " --training.skip_nonfinite_steps");
  EXPECT_EQ(skip.exit_code, 0) << skip.text;
  EXPECT_NE(skip.text.find("skipped"), std::string::npos) << skip.text;
}

TEST(Train, CtrlCStopsCleanlyAndSaysWhere) {
  const fs::path data = make_dataset(), dump = anvil::testing::scratch_root() / "anvil_train_test_int";
  const Output out = run("train " + common_args(data, dump) + " --training.steps 100000", "timeout --preserve-status -s INT 4 ");
  EXPECT_EQ(out.exit_code, 130) << out.text;
  EXPECT_NE(out.text.find("interrupted"), std::string::npos) << out.text;
}

TEST(Train, BadInputGetsOneClearLine) {
  Output out = run("train /nonexistent/job.toml");
  EXPECT_EQ(out.exit_code, 1);
  EXPECT_EQ(out.text, "anvil: error: cannot read config file '/nonexistent/job.toml': No such file or directory; "
                      "pass an existing .toml (see configs/)\n");
  out = run("train --training.dataset brown --training.dataset_path /nonexistent/brown --training.steps 1");
  EXPECT_EQ(out.exit_code, 1);
  EXPECT_NE(out.text.find("anvil: error: Brown corpus folder '/nonexistent/brown' not found"), std::string::npos)
      << out.text;
  out = run("train --training.stesp 3");
  EXPECT_EQ(out.exit_code, 1);
  EXPECT_NE(out.text.find("did you mean 'training.steps'"), std::string::npos) << out.text;
  // A run that cannot fit is refused before anything is allocated.
  out = run("train --model.flavor 8B --training.seq_len 8192 --training.local_batch_size 1");
  EXPECT_EQ(out.exit_code, 1);
  EXPECT_NE(out.text.find(", over the "), std::string::npos) << out.text;
  // It says first how big the model is and which rank, then what would fit: FSDP ranks and an AC mode.
  EXPECT_EQ(out.text.find("anvil: error: llama3/8B has 8,030,261,248 parameters; predicted peak memory of rank 0"),
            0u)
      << out.text;
  EXPECT_NE(out.text.find("FSDP ranks with activation_checkpoint.mode = \"full\""), std::string::npos) << out.text;
  // Muon's settings and groups.
  out = run("train --optimizer.name Muon --optimizer.muon_adjust_lr_fn match_rms");
  EXPECT_EQ(out.exit_code, 1);
  EXPECT_NE(out.text.find("optimizer.muon_adjust_lr_fn"), std::string::npos) << out.text;
  EXPECT_NE(out.text.find("match_rms_adamw"), std::string::npos) << out.text;
  out = run("train --optimizer.name Muon --optimizer.muon_ns_steps 0");
  EXPECT_EQ(out.exit_code, 1);
  EXPECT_NE(out.text.find("optimizer.muon_ns_steps"), std::string::npos) << out.text;
  out = run("train --optimizer.name Muon --optimizer.adamw_params model.embed_tokens.weight");
  EXPECT_EQ(out.exit_code, 1);
  EXPECT_NE(out.text.find("anvil: error: optimizer.name = \"Muon\": parameter model.layers.0.input_layernorm.weight "
                          "matches neither"),
            std::string::npos)
      << out.text;
}

TEST(Train, ReadsTokenShardsAndJsonLines) {
  const fs::path data = make_dataset(), dir = anvil::testing::scratch_root() / "anvil_train_test_shards";
  fs::remove_all(dir);
  fs::create_directories(dir);
  {
    std::ofstream jsonl(dir / "docs.jsonl");
    for (int i = 0; i < 200; ++i)
      jsonl << "{\"text\": \"Document " << i << " says the jury praised the election.\"}\n";
  }
  Output out = run("tokenize --no-progress --input " + (dir / "docs.jsonl").string() + " --output-dir " +
                   (dir / "shards").string());
  ASSERT_EQ(out.exit_code, 0) << out.text;
  const std::string common = " --training.seq_len 32 --training.local_batch_size 2 --training.steps 3"
                             " --metrics.log_freq 1 --job.dump_folder " + (dir / "out").string();
  out = run("train --training.dataset shards --training.dataset_path " + (dir / "shards").string() + common);
  EXPECT_EQ(out.exit_code, 0) << out.text;
  EXPECT_NE(out.text.find("done: 3 steps"), std::string::npos) << out.text;
  out = run("train --training.dataset text --training.dataset_path " + (dir / "docs.jsonl").string() + common);
  EXPECT_EQ(out.exit_code, 0) << out.text;
  // Shards made with another tokenizer (bytes, here) are refused.
  out = run("tokenizer train --vocab-size 300 --input " + data.string() + " --output " + (dir / "tok.json").string());
  ASSERT_EQ(out.exit_code, 0) << out.text;
  out = run("train --training.dataset shards --training.dataset_path " + (dir / "shards").string() +
            " --model.tokenizer_path " + (dir / "tok.json").string() + common);
  EXPECT_EQ(out.exit_code, 1) << out.text;
  EXPECT_NE(out.text.find("tokenizer"), std::string::npos) << out.text;
}

// The brown dataset kind, for those who have the corpus: a folder of files in
// its tagged format (made here; the corpus itself is not fetched any more).
// The tags come off, every 20th file is held out, and training and validation
// run on the two splits; `tokenizer train --brown` reads the same folder.
TEST(Train, ReadsABrownCorpusFolder) {
  const fs::path dir = anvil::testing::scratch_root() / "anvil_train_test_brown";
  fs::remove_all(dir);
  fs::create_directories(dir / "brown");
  for (int i = 0; i < 20; ++i) {
    char name[8];
    std::snprintf(name, sizeof name, "ca%02d", i + 1);
    std::ofstream f(dir / "brown" / name);
    for (int line = 0; line < 30; ++line)
      f << "\n\n\tThe/at jury/nn said/vbd ``/`` no/at ''/'' ,/, and/cc the/at city/nn-tl " << i
        << "/cd thanked/vbd them/ppo ./.\n";
  }
  std::ofstream(dir / "brown" / "README") << "not a corpus file: skipped\n";
  EXPECT_EQ(anvil::strip_brown_tags("\tThe/at jury/nn said/vbd ``/`` no/at ''/'' ,/, and/cc ./.\n"),
            "The jury said \"no\", and.\n");
  const std::string common = " --training.dataset brown --training.dataset_path " + (dir / "brown").string() +
                             " --training.seq_len 32 --training.local_batch_size 2 --training.steps 4"
                             " --metrics.log_freq 1 --validation.enable --validation.freq 2 --validation.steps 1"
                             " --job.dump_folder " + (dir / "out").string();
  Output out = run("train" + common);
  ASSERT_EQ(out.exit_code, 0) << out.text;
  EXPECT_NE(out.text.find("dataset brown at " + (dir / "brown").string() + ": 19 train documents ("),
            std::string::npos)
      << out.text;
  EXPECT_NE(out.text.find("), 1 validation"), std::string::npos) << out.text;
  EXPECT_NE(out.text.find("step     4 | validation loss"), std::string::npos) << out.text;
  // The tagged text has 39 merges to learn (the tags would give more).
  out = run("tokenizer train --vocab-size 297 --brown " + (dir / "brown").string() + " --output " +
            (dir / "tok.json").string());
  EXPECT_EQ(out.exit_code, 0) << out.text;
  EXPECT_NE(out.text.find("vocab 297 = 256 bytes + 39 merges + 2 special"), std::string::npos) << out.text;
}
