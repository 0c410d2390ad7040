// The console a person reads: the step line fits 120 columns with every
// number labelled, shows step N/total and an ETA; the long form is one key
// away; a resumed run's summary starts from the checkpoint's own loss; stdout
// and stderr keep their order in one file.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "anvil/train/metrics.h"
#include "test_util.h"

namespace fs = std::filesystem;

namespace {

using Output = anvil::testing::CommandOutput;

// Display columns: UTF-8 continuation bytes take none (the expert bars are 3 bytes each).
size_t columns(const std::string& line) {
  size_t n = 0;
  for (const char c : line) n += (static_cast<unsigned char>(c) & 0xC0) != 0x80;
  return n;
}

anvil::StepLog busy_step() {
  anvil::StepLog s;
  s.step = 1500;
  s.total_steps = 10000;
  s.loss = 12.3456;
  s.grad_norm = 12.345;
  s.lr = 3e-4;
  s.tokens_per_s = 1234567;
  s.mfu_pct = 45.67;
  s.memory.peak_total = size_t{123} << 30;
  s.eta_s = 3 * 86400 + 7200;
  return s;
}

fs::path workdir(const std::string& name) {
  const fs::path dir = anvil::testing::scratch_root() / ("anvil_console_test_" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream text(dir / "text.txt");
  for (int i = 0; i < 300; ++i) text << "Line " << i % 9 << ": the river ran past the mill and under the bridge.\n";
  return dir;
}

// Run inside `dir` with relative paths, as a person would type them.
Output train(const fs::path& dir, const std::string& more) {
  return anvil::testing::run_anvil(
      "train --training.dataset text --training.dataset_path text.txt --training.seq_len 32"
      " --training.local_batch_size 2 --metrics.log_freq 1 --lr_scheduler.warmup_steps 2 --job.dump_folder run " + more,
      "cd '" + dir.string() + "' && ");
}

}  // namespace

TEST(Console, TheStepLineFits120ColumnsWithLabelledNumbersAndAnEta) {
  anvil::StepLog s = busy_step();
  const std::string line = anvil::step_line(s, false);
  EXPECT_LE(columns(line), 120u) << line;
  for (const char* label : {"step 1500/10000 |", "| loss 12.3456 |", "| grad_norm 12.345 |", "| lr 3.0e-04 |",
                            "| 1,234,567 tok/s |", "| MFU 45.7% |", "| mem 123.00 GiB,", ", ETA 3d02h"})
    EXPECT_NE(line.find(label), std::string::npos) << label << " in\n" << line;
  // Distributed: the fullest rank's memory.
  s.world_size = 64;
  s.max_memory_over_ranks = size_t{130} << 30;
  EXPECT_LE(columns(anvil::step_line(s, false)), 120u) << anvil::step_line(s, false);
  EXPECT_NE(anvil::step_line(s, false).find("| mem 130.00 GiB,"), std::string::npos);
  // A mixture of experts' routing goes on a line of its own, itself within 120 columns.
  s.moe_experts = 48;
  s.moe_aux_loss = 1.2345;
  s.moe_routes.assign(48 * 2, 1.0);
  const std::string moe = anvil::step_line(s, false);
  const size_t nl = moe.find('\n');
  ASSERT_NE(nl, std::string::npos) << moe;
  EXPECT_LE(columns(moe.substr(0, nl)), 120u);
  EXPECT_LE(columns(moe.substr(nl + 1)), 120u) << moe.substr(nl + 1);
  EXPECT_NE(moe.find("aux 1.2345 | experts "), std::string::npos) << moe;
  // The last step has no ETA.
  s.step = s.total_steps;
  s.eta_s = -1;
  EXPECT_EQ(anvil::step_line(s, false).find("ETA"), std::string::npos);
}

TEST(Console, TheVerboseLineLabelsEveryFigure) {
  anvil::StepLog s = busy_step();
  s.tflops = 1.5;
  s.data_pct = 2.5;
  s.elapsed_s = 61.25;
  const std::string line = anvil::step_line(s, true);
  for (const char* label : {"| 1.500 TFLOP/s |", "| data loading 2.5% of the time |", "| 61.2 s elapsed", "(param ",
                            ", ETA 3d02h"})
    EXPECT_NE(line.find(label), std::string::npos) << label << " in\n" << line;
}

TEST(Console, DurationsReadAsPeopleWriteThem) {
  EXPECT_EQ(anvil::duration_text(42.4), "42s");
  EXPECT_EQ(anvil::duration_text(725), "12m05s");
  EXPECT_EQ(anvil::duration_text(3 * 3600 + 12 * 60 + 59), "3h12m");
  EXPECT_EQ(anvil::duration_text(2 * 86400 + 3 * 3600), "2d03h");
}

TEST(Console, ARunPrintsStepOfTotalAndEtaAndAResumedRunSummarisesFromItsCheckpoint) {
  const fs::path dir = workdir("run");
  const std::string ck = " --checkpoint.enable --checkpoint.interval 3";
  Output out = train(dir, ck + " --training.steps 3");
  ASSERT_EQ(out.exit_code, 0) << out.text;
  std::istringstream lines(out.text);
  int steps = 0;
  std::string step3_loss;
  for (std::string line; std::getline(lines, line);) {
    EXPECT_LE(columns(line), 200u) << line;  // every line a person reads
    if (line.rfind("step ", 0) != 0) continue;
    ++steps;
    EXPECT_LE(columns(line), 120u) << line;
    EXPECT_NE(line.find("step " + std::to_string(steps) + "/3 |"), std::string::npos) << line;
    EXPECT_EQ(line.find("ETA") != std::string::npos, steps < 3) << line;
    if (steps == 3) step3_loss = line.substr(line.find("loss ") + 5, 6);
  }
  EXPECT_EQ(steps, 3) << out.text;
  EXPECT_NE(out.text.find("anvil: done: 3 steps, loss "), std::string::npos) << out.text;
  // One step after resuming: the loss runs from step 3's, which the checkpoint kept.
  out = train(dir, ck + " --training.steps 4");
  ASSERT_EQ(out.exit_code, 0) << out.text;
  EXPECT_NE(out.text.find("anvil: done: steps 4-4 (resumed from step 3), loss " + step3_loss), std::string::npos)
      << "step 3's loss " << step3_loss << "\n" << out.text;
  EXPECT_NE(out.text.find("(step 3) -> "), std::string::npos) << out.text;
}

TEST(Console, StdoutAndStderrKeepTheirOrderInOneFile) {
  const fs::path dir = workdir("order");
  // The banner (stdout) comes before the error (stderr) that a missing
  // validation file raises once the data is opened.
  const Output out = train(dir, "--training.steps 1 --validation.enable true --validation.dataset_path gone.txt");
  EXPECT_EQ(out.exit_code, 1) << out.text;
  const size_t banner = out.text.find("anvil: llama3/debugmodel"), error = out.text.find("anvil: error:");
  ASSERT_NE(banner, std::string::npos) << out.text;
  ASSERT_NE(error, std::string::npos) << out.text;
  EXPECT_LT(banner, error) << out.text;
}
