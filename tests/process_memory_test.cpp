// The whole process's memory: does the per-rank estimate's reserved bytes (the
// allocator's live and cached blocks, train/estimate.h), plus what the
// allocator does not see (the binary and libraries, threads, MPI's buffers,
// oneDNN's kernels, the data loader), make up the peak resident set the kernel
// reports (ru_maxrss)? Margin: 5% of the peak RSS.
// What this checks is the accounting, not a forecast: the untracked part is
// measured in the same run (the trainer takes the resident set minus the
// reserved bytes at each logged step; it settles over the first steps as
// oneDNN generates its kernels and MPI and the C library's heap grow, so the
// last logged step's figure of a 5-step run is taken). A tensor the
// allocator missed, or a cache that held blocks the estimate does not, shows
// as a gap.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "anvil/train/config.h"
#include "anvil/train/estimate.h"
#include "mpi_test_util.h"
#include "test_util.h"

namespace anvil {
namespace {

namespace fs = std::filesystem;

fs::path text_corpus() {
  const fs::path dir = anvil::testing::scratch_root() / "rss";
  fs::create_directories(dir);
  std::ofstream text(dir / "text.txt");
  for (int i = 0; i < 3000; ++i)
    text << "Line " << i % 31 << ": the jury said the city's election was conducted with praise, " << i * 7 % 13
         << " times.\n";
  return dir / "text.txt";
}

// anvil train's flags for a short run of `model_flags` on the corpus, dumping to `dump`.
std::string train_args(const fs::path& dump, const std::string& model_flags) {
  return "train --training.dataset text --training.dataset_path " + text_corpus().string() +
         " --training.steps 5 --metrics.log_freq 1 --checkpoint.enable false --metrics.enable_tensorboard false "
         "--job.dump_folder " +
         dump.string() + " " + model_flags;
}

// Per rank: the estimate's reserved bytes plus the measured untracked part, over the peak RSS, minus 1.
std::vector<double> rss_errors(const fs::path& dump, const std::string& args, int ranks) {
  std::vector<std::string> words;
  std::istringstream in(args);
  for (std::string w; in >> w;)
    if (w != "train") words.push_back(w);
  const JobConfig cfg = parse_config(words);
  const LayoutEstimate est = estimate_layout(cfg, job_model_args(cfg), ranks);
  std::vector<double> rss(static_cast<size_t>(ranks), 0), untracked(static_cast<size_t>(ranks), 0);
  std::ifstream metrics(dump / "metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (!j.contains("loss")) continue;
    for (int r = 0; r < ranks; ++r) {
      const auto i = static_cast<size_t>(r);
      rss[i] = std::max(rss[i], ranks == 1 ? j["peak_rss_bytes"].get<double>()
                                           : j["peak_rss_mib_by_rank"][i].get<double>() * (1 << 20));
      untracked[i] = ranks == 1 ? j["untracked_bytes"].get<double>()  // the last line's, once it has settled
                                : j["untracked_mib_by_rank"][i].get<double>() * (1 << 20);
    }
  }
  std::vector<double> errors;
  for (int r = 0; r < ranks; ++r) {
    const auto i = static_cast<size_t>(r);
    EXPECT_GT(rss[i], 0) << "no peak RSS logged in " << dump;
    const double predicted = static_cast<double>(est.ranks[i].memory.peak_reserved) + untracked[i];
    errors.push_back(predicted / rss[i] - 1);
    std::printf("rank %d: estimate %.1f MiB + untracked (measured) %.1f MiB = %.1f MiB; peak RSS %.1f MiB (%+.2f%%)\n",
                r, static_cast<double>(est.ranks[i].memory.peak_reserved) / (1 << 20), untracked[i] / (1 << 20),
                predicted / (1 << 20), rss[i] / (1 << 20), 100 * errors.back());
  }
  return errors;
}

TEST(ProcessMemory, The125MRunPeakRssIsTheEstimatePlusTheUntrackedPartWithinFivePercent) {
  const fs::path dump = anvil::testing::scratch_root() / "rss_125m";
  fs::remove_all(dump);
  const std::string args =
      train_args(dump, "--model.flavor 125M --training.seq_len 1024 --training.local_batch_size 1 "
                       "--training.mixed_precision_param bfloat16");
  const anvil::testing::CommandOutput out = anvil::testing::run_anvil(args, "OMP_NUM_THREADS=2 ");
  ASSERT_EQ(out.exit_code, 0) << out.text;
  for (double e : rss_errors(dump, args, 1)) EXPECT_LE(std::abs(e), 0.05);
}

TEST(ProcessMemory, AnFsdp2RunPeakRssIsTheEstimatePlusTheUntrackedPartWithinFivePercent) {
  const fs::path dump = anvil::testing::scratch_root() / "rss_fsdp2";
  fs::remove_all(dump);
  const std::string args = train_args(dump, "--parallelism.data_parallel_shard_degree 2 --training.seq_len 256 "
                                            "--training.local_batch_size 8");
  const anvil::testing::CommandOutput out = anvil::testing::run_anvil(args, anvil::testing::mpirun_prefix(2));
  ASSERT_EQ(out.exit_code, 0) << out.text;
  for (double e : rss_errors(dump, args, 2)) EXPECT_LE(std::abs(e), 0.05);
}

// Under learned routing the row counts of the experts' products change every
// step. Every kernel and buffer a step needs is made in step 1 when each of
// them is bounded (ops/moe_experts.h), so the untracked part then all but
// stops growing. Its growth after step 1 is held to 5% of the estimate's
// reserved bytes (what the job is predicted to hold; the binary's own size,
// which differs between builds, plays no part): measured 1.2% to 2.6% over
// these 20 steps (2.0 to 4.3 MiB, the CUDA build here and the CPU build of a
// fresh root), where a kernel kept per row count grew it by 20% (35 MiB). And so the peak RSS is the prediction made
// after step 1 (the estimate plus step 1's untracked part, which the trainer prints), within the 5% margin.
TEST(ProcessMemory, LearnedRoutingStopsGrowingTheUntrackedPartAfterStepOne) {
  const fs::path dump = anvil::testing::scratch_root() / "rss_moe_learned";
  fs::remove_all(dump);
  const std::string args = train_args(dump,
                                      "--model.name qwen3 --model.flavor debugmodel_moe --model.moe_routing "
                                      "learned --training.seq_len 128 --training.local_batch_size 4 "
                                      "--training.mixed_precision_param bfloat16 --training.steps 20");
  const anvil::testing::CommandOutput out = anvil::testing::run_anvil(args, "OMP_NUM_THREADS=2 ");
  ASSERT_EQ(out.exit_code, 0) << out.text;
  std::vector<double> untracked;
  double peak_rss = 0;
  std::ifstream metrics(dump / "metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (!j.contains("loss")) continue;
    untracked.push_back(j["untracked_bytes"].get<double>());
    peak_rss = std::max(peak_rss, j["peak_rss_bytes"].get<double>());
  }
  ASSERT_EQ(untracked.size(), 20u) << "one line a step in " << dump;
  std::vector<std::string> words;
  std::istringstream in(args);
  for (std::string w; in >> w;)
    if (w != "train") words.push_back(w);
  const JobConfig cfg = parse_config(words);
  const double reserved =
      static_cast<double>(estimate_layout(cfg, job_model_args(cfg), 1).ranks[0].memory.peak_reserved);
  const double growth = *std::max_element(untracked.begin(), untracked.end()) - untracked.front();
  std::printf("untracked after step 1 %.1f MiB, grew by %.1f MiB (%.2f%% of the estimate's %.1f MiB)\n",
              untracked.front() / (1 << 20), growth / (1 << 20), 100 * growth / reserved, reserved / (1 << 20));
  EXPECT_LE(growth, 0.05 * reserved);
  const double predicted = reserved + untracked.front();
  std::printf("predicted after step 1 %.1f MiB, peak RSS %.1f MiB (%+.2f%%)\n", predicted / (1 << 20),
              peak_rss / (1 << 20), 100 * (peak_rss / predicted - 1));
  EXPECT_LE(std::abs(peak_rss / predicted - 1), 0.05);
}

}  // namespace
}  // namespace anvil
