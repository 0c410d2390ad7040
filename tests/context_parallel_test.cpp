// Context parallelism. In one process: which chunks each rank holds under
// both load balancers, and the local tokens of a batch. Under mpirun
// (tests/cp_worker.cpp, 2 and 4 ranks): a rank's chunks through
// ContextParallel's RoPE and attention, forward and backward, against the
// whole sequences' single-process kernels. And the trainer through the parity
// harness (tests/layout_parity.h): every cp layout's 10 steps against the
// single process, and its memory against its dry run, event for event.
#include "anvil/distributed/context_parallel.h"

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include "layout_parity.h"
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

TEST(ContextParallelAttention, TwoRanksMatchTheWholeSequences) {
  anvil::testing::expect_worker_passes(ANVIL_CP_WORKER, 2, 5);
}
TEST(ContextParallelAttention, FourRanksMatchTheWholeSequences) {
  anvil::testing::expect_worker_passes(ANVIL_CP_WORKER, 4, 5);
}

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

using anvil::testing::LayoutParity;
TEST_P(LayoutParity, MatchesSingleProcess) { anvil::testing::expect_matches_single_process(GetParam()); }
INSTANTIATE_TEST_SUITE_P(ContextParallel, LayoutParity,
                         ::testing::ValuesIn(anvil::testing::parity_cases([](const anvil::testing::Layout& l) {
                           return l.cp > 1;
                         })),
                         anvil::testing::parity_case_name);

namespace {

namespace fs = std::filesystem;

// Resumes `from`'s step-5 checkpoint (copied) under `layout` with `local`
// sequences per rank; returns the worst relative loss difference over steps
// 6-10 from `want`'s run.
double resume_as(const std::string& from, const anvil::testing::Layout& layout, int64_t local, const std::string& batch,
                 const std::map<int64_t, double>& want) {
  auto& r = anvil::testing::runs();
  const std::string dump = from + "_as_" + layout.name;
  fs::remove_all(r.dir() / dump);
  fs::create_directories(r.dir() / dump);
  fs::copy(r.dir() / from / "checkpoint", r.dir() / dump / "checkpoint", fs::copy_options::recursive);
  const auto out = r.run(layout, dump, batch + "--training.local_batch_size " + std::to_string(local));
  EXPECT_EQ(out.exit_code, 0) << out.text;
  EXPECT_NE(out.text.find("resumed from " + (r.dir() / dump / "checkpoint" / "step-5").string()), std::string::npos)
      << out.text;
  const auto got = r.losses(dump);
  EXPECT_EQ(got.size(), 5u) << out.text;
  double worst = 0;
  for (const auto& [step, loss] : got)
    worst = std::max(worst, std::abs(loss - want.at(step)) / std::abs(want.at(step)));
  return worst;
}

}  // namespace

// A checkpoint saved under CP 2 holds the global tensors: it resumes in one
// process, under FSDP 2 and under CP 4, and a single process's resumes under
// CP 2, each holding steps 6-10 to the uninterrupted run within 1e-6 (the
// parity bound: the layouts differ only in the order of sums).
TEST(ContextParallelCheckpoint, MovesBetweenCpAndOtherLayouts) {
  auto& r = anvil::testing::runs();
  // A constant learning rate after warm-up, so stopping at step 5 changes nothing before it.
  const std::string batch = "--training.global_batch_size 2 --lr_scheduler.decay_ratio 0 ";
  const anvil::testing::Layout& cp2 = anvil::testing::layout("cp2");
  const auto whole = r.run(cp2, "cpx_whole", batch + "--training.local_batch_size 2");
  ASSERT_EQ(whole.exit_code, 0) << whole.text;
  const auto saved = r.run(cp2, "cpx_saved", batch + "--training.local_batch_size 2 --training.steps 5");
  ASSERT_EQ(saved.exit_code, 0) << saved.text;
  const auto want = r.losses("cpx_whole");
  ASSERT_EQ(want.size(), 10u);
  for (const auto& [target, local] :
       std::vector<std::pair<std::string, int64_t>>{{"single", 2}, {"fsdp2", 1}, {"cp4", 2}}) {
    const double worst = resume_as("cpx_saved", anvil::testing::layout(target), local, batch, want);
    std::printf("CP 2 checkpoint resumed as %-6s: worst loss difference %.2e over steps 6-10\n", target.c_str(), worst);
    EXPECT_LE(worst, 1e-6) << target;
  }
  // And the other way: a single process's checkpoint resumed under CP 2.
  const anvil::testing::Layout& single = anvil::testing::layout("single");
  const auto single_saved =
      r.run(single, "cpx_single_saved", batch + "--training.local_batch_size 2 --training.steps 5");
  ASSERT_EQ(single_saved.exit_code, 0) << single_saved.text;
  const auto single_whole = r.run(single, "cpx_single_whole", batch + "--training.local_batch_size 2");
  ASSERT_EQ(single_whole.exit_code, 0) << single_whole.text;
  const double worst = resume_as("cpx_single_saved", cp2, 2, batch, r.losses("cpx_single_whole"));
  std::printf("single-process checkpoint resumed as cp2: worst loss difference %.2e over steps 6-10\n", worst);
  EXPECT_LE(worst, 1e-6);
}

// bf16, against the single bf16 process: the bound of the data-parallel
// layouts (tests/distributed_test.cpp, 5e-4 relative per step, an eighth of a
// bf16 ulp of the loss): CP sums the weights' gradients over the FSDP shards
// in another order, as they do, and adds its keys' gradients over the chunks
// and ranks in bf16, each addition one more rounding at 2^-9 of a gradient
// that the fp32 update then averages over thousands of products.
TEST(ContextParallelBf16, LayoutsStayWithinTheirToleranceOfTheSingleProcess) {
  for (const char* name : {"cp2", "cp4", "cp2_fsdp2"}) {
    // The ring (the default) rounds a little more than the all-gather: each
    // block's partial attention to bf16 before the merge, and the keys'
    // gradient sum at every hop; a few more roundings of 2^-9 per element,
    // inside the same bound.
    anvil::testing::expect_bf16_within(anvil::testing::layout(name), 1, 5e-4);
    anvil::testing::expect_bf16_within(anvil::testing::layout(name), 1, 5e-4,
                                       {"allgather", anvil::testing::kAllgather});
  }
}
