// Helpers shared by the tests that run anvil under mpirun and compare layouts.
#pragma once
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>

#include "anvil/core/safetensors.h"

namespace anvil::testing {

// Runs `ranks` processes as root if need be, one OpenMP thread each (they
// share the machine's cores); a hang ends after 300 s instead of stalling CI.
inline std::string mpirun_prefix(int ranks) {
  return "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 "
         "timeout -k 5 300 mpirun --oversubscribe --bind-to none -np " +
         std::to_string(ranks) + " ";
}

// A GoogleTest program with its own main (comm_worker, tp_worker, cp_worker)
// under mpirun with `ranks` ranks: it exits 0 with `tests` tests passed and
// no rank reports a failure; a hang (a rank missing a collective) becomes
// mpirun_prefix's timeout, exit code 124. Its output is printed.
inline void expect_worker_passes(const std::string& worker, int ranks, int tests) {
  std::string output;
  FILE* p = popen((mpirun_prefix(ranks) + worker + " --gtest_color=no 2>&1").c_str(), "r");
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) output.append(buf, n);
  const int status = pclose(p);
  EXPECT_EQ(WIFEXITED(status) ? WEXITSTATUS(status) : -1, 0) << output;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(output, m, std::regex(R"(\[  PASSED  \] (\d+) tests?\.)"))) << output;
  EXPECT_EQ(std::stoi(m[1]), tests) << output;
  EXPECT_EQ(output.find("FAILED"), std::string::npos) << output;
  EXPECT_EQ(output.find("failed"), std::string::npos) << output;  // another rank's failure
  std::printf("%s", output.c_str());
}

// A run's `key` ("loss", "grad_norm") by step from its metrics.jsonl, the
// training lines only, the last line of a step winning.
inline std::map<int64_t, double> metric_by_step(const std::filesystem::path& metrics_jsonl, const char* key) {
  std::map<int64_t, double> out;
  std::ifstream in(metrics_jsonl);
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j.contains("loss")) out[j["step"].get<int64_t>()] = j[key].get<double>();
  }
  return out;
}

// ||a − b|| / ||b|| over every tensor of two safetensors files, which must
// hold the same names and global shapes.
inline double safetensors_relative_difference(const std::filesystem::path& a, const std::filesystem::path& b) {
  const auto wa = load_safetensors(a.string());
  const auto wb = load_safetensors(b.string());
  EXPECT_EQ(wa.tensors.size(), wb.tensors.size());
  double diff = 0, norm = 0;
  for (const auto& [name, tb] : wb.tensors) {
    const auto it = wa.tensors.find(name);
    if (it == wa.tensors.end()) {
      ADD_FAILURE() << "missing " << name;
      continue;
    }
    EXPECT_EQ(it->second.shape(), tb.shape()) << name;
    const float* x = it->second.data<float>();
    const float* y = tb.data<float>();
    for (int64_t i = 0; i < tb.numel(); ++i) {
      diff += (static_cast<double>(x[i]) - y[i]) * (static_cast<double>(x[i]) - y[i]);
      norm += static_cast<double>(y[i]) * y[i];
    }
  }
  return std::sqrt(diff / norm);
}

// On ranks other than 0 of a GoogleTest program run under mpirun (comm_worker,
// tp_worker), GoogleTest stays quiet except for failures, each prefixed with
// the rank, so a 4-rank run prints one report, not four.
class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}
  // The name is kept here because OnTestPartResult runs under GoogleTest's
  // lock, where UnitTest::current_test_info() would deadlock.
  void OnTestStart(const ::testing::TestInfo& test) override {
    test_ = std::string(test.test_suite_name()) + "." + test.name();
  }
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "rank %d: %s failed at %s:%d\n%s\n", rank_, test_.c_str(),
                 result.file_name() ? result.file_name() : "?", result.line_number(), result.summary());
  }

 private:
  int rank_;
  std::string test_;
};

// Call after InitGoogleTest: only rank 0 prints GoogleTest's report.
inline void report_only_failures_unless_rank_0(int rank) {
  if (rank == 0) return;
  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  delete listeners.Release(listeners.default_result_printer());
  listeners.Append(new RankFailurePrinter(rank));
}

}  // namespace anvil::testing
