// Context parallelism. In one process: which chunks each rank holds under
// both load balancers, and the local tokens of a batch. Under mpirun
// (tests/cp_worker.cpp, 2 and 4 ranks): a rank's chunks through
// ContextParallel's RoPE and attention, forward and backward, against the
// whole sequences' single-process kernels.
#include "anvil/distributed/context_parallel.h"

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <regex>
#include <string>
#include <vector>

#include "mpi_test_util.h"

using namespace anvil;

TEST(ContextParallelChunks, HeadTailPairsTheFirstAndLastChunks) {
  // cp 4: 8 chunks; rank i holds i and 7 − i, so every rank's causal work is 1 + 2·… equal.
  const std::vector<std::pair<int64_t, int64_t>> want = {{0, 7}, {1, 6}, {2, 5}, {3, 4}};
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(cp_chunk(CpLoadBalancer::headtail, 4, r, 0), want[static_cast<size_t>(r)].first);
    EXPECT_EQ(cp_chunk(CpLoadBalancer::headtail, 4, r, 1), want[static_cast<size_t>(r)].second);
    // The attention work of a chunk at position p is ∝ p + ½ under the causal mask: equal per rank.
    EXPECT_EQ(cp_chunk(CpLoadBalancer::headtail, 4, r, 0) + cp_chunk(CpLoadBalancer::headtail, 4, r, 1), 7);
    EXPECT_EQ(cp_chunk(CpLoadBalancer::none, 4, r, 0), 2 * r);
    EXPECT_EQ(cp_chunk(CpLoadBalancer::none, 4, r, 1), 2 * r + 1);
  }
  EXPECT_EQ(cp_load_balancer("headtail"), CpLoadBalancer::headtail);
  EXPECT_EQ(cp_load_balancer("none"), CpLoadBalancer::none);
  try {
    cp_load_balancer("roundrobin");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("parallelism.context_parallel_load_balancer is \"roundrobin\""),
              std::string::npos)
        << e.what();
  }
}

namespace {

struct CommandRun {
  int exit_code;
  std::string output;
};

CommandRun run_command(const std::string& command) {
  CommandRun out{-1, ""};
  FILE* p = popen((command + " 2>&1").c_str(), "r");
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.output.append(buf, n);
  const int status = pclose(p);
  out.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return out;
}

void expect_worker_passes(int ranks) {
  const CommandRun r = run_command(anvil::testing::mpirun_prefix(ranks) + ANVIL_CP_WORKER + " --gtest_color=no");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.output, m, std::regex(R"(\[  PASSED  \] (\d+) tests?\.)"))) << r.output;
  EXPECT_EQ(std::stoi(m[1]), 2) << r.output;
  EXPECT_EQ(r.output.find("FAILED"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("failed"), std::string::npos) << r.output;  // another rank's failure
  std::printf("%s", r.output.c_str());
}

}  // namespace

TEST(ContextParallelAttention, TwoRanksMatchTheWholeSequences) { expect_worker_passes(2); }
TEST(ContextParallelAttention, FourRanksMatchTheWholeSequences) { expect_worker_passes(4); }

// A batch's local tokens: the rank's first chunk of every sequence, then its
// second (a dry communicator stands for the cp group: only its rank and size count).
TEST(ContextParallelChunks, LocalTokensAreTheRanksChunksOfEverySequence) {
  std::vector<int32_t> tokens(16);
  for (int32_t i = 0; i < 16; ++i) tokens[static_cast<size_t>(i)] = i;  // 2 sequences of 8
  Communicator rank0 = Communicator::dry(0, 2), rank1 = Communicator::dry(1, 2);
  std::vector<int32_t> local(8);
  ContextParallel(rank0, CpLoadBalancer::headtail).local_tokens(tokens.data(), 2, 8, local.data());
  EXPECT_EQ(local, (std::vector<int32_t>{0, 1, 8, 9, 6, 7, 14, 15}));  // chunks 0 and 3 of 4
  ContextParallel(rank1, CpLoadBalancer::headtail).local_tokens(tokens.data(), 2, 8, local.data());
  EXPECT_EQ(local, (std::vector<int32_t>{2, 3, 10, 11, 4, 5, 12, 13}));  // chunks 1 and 2
  ContextParallel(rank1, CpLoadBalancer::none).local_tokens(tokens.data(), 2, 8, local.data());
  EXPECT_EQ(local, (std::vector<int32_t>{4, 5, 12, 13, 6, 7, 14, 15}));  // chunks 2 and 3
}
