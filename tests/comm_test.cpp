// The distributed layer. In this process (no MPI): the mesh's coordinate
// maths for several layouts, the validators' messages, the config hash, the
// byte formulas. Under mpirun: tests/comm_worker.cpp, run here with 4 and 2
// ranks and as a singleton, plus the failure scenarios (a config mismatch on
// one rank, a rank calling abort_all).
#include "anvil/distributed/comm.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "anvil/distributed/config_check.h"
#include "anvil/distributed/mesh.h"

using namespace anvil;

namespace {

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

MeshCoord coord(int pp, int rep, int shard, int tp, int cp = 0) { return MeshCoord{{pp, rep, shard, cp, tp}}; }

}  // namespace

// ---------------------------------------------------------------------------
// Mesh layout maths

TEST(MeshLayout, RanksAreRowMajorWithTpFastest) {
  const MeshLayout m(2, 1, 2, 1, 2);  // pp 2 × dp_shard 2 × tp 2
  EXPECT_EQ(m.world_size(), 8);
  EXPECT_EQ(m.dp(), 2);
  const MeshCoord want[8] = {coord(0, 0, 0, 0), coord(0, 0, 0, 1), coord(0, 0, 1, 0), coord(0, 0, 1, 1),
                             coord(1, 0, 0, 0), coord(1, 0, 0, 1), coord(1, 0, 1, 0), coord(1, 0, 1, 1)};
  for (int r = 0; r < 8; ++r) {
    EXPECT_EQ(m.coord_of(r), want[r]) << r;
    EXPECT_EQ(m.rank_of(want[r]), r);
  }
  const MeshLayout hsdp(1, 3, 2, 1, 1);  // dp_replicate 3 × dp_shard 2
  EXPECT_EQ(hsdp.coord_of(5), coord(0, 2, 1, 0));
  EXPECT_EQ(hsdp.coord_of(2), coord(0, 1, 0, 0));
}

TEST(MeshLayout, GroupsOfPpShardTp) {
  const MeshLayout m(2, 1, 2, 1, 2);
  // Rank 5 sits at pp 1, dp_shard 0, tp 1.
  EXPECT_EQ(m.group_ranks(5, MeshGroup::tp), (std::vector<int>{4, 5}));
  EXPECT_EQ(m.group_ranks(5, MeshGroup::dp_shard), (std::vector<int>{5, 7}));
  EXPECT_EQ(m.group_ranks(5, MeshGroup::dp), (std::vector<int>{5, 7}));
  EXPECT_EQ(m.group_ranks(5, MeshGroup::pp), (std::vector<int>{1, 5}));
  EXPECT_EQ(m.group_ranks(5, MeshGroup::dp_replicate), (std::vector<int>{5}));
  EXPECT_EQ(m.group_rank(5, MeshGroup::tp), 1);
  EXPECT_EQ(m.group_rank(5, MeshGroup::pp), 1);
  EXPECT_EQ(m.group_rank(5, MeshGroup::dp_shard), 0);
}

// CP 2 between dp_shard and tp: rank = ((dp_shard)·2 + cp)·2 + tp.
TEST(MeshLayout, GroupsOfFsdpWithCpAndTp) {
  const MeshLayout m(1, 1, 2, 2, 2);  // dp_shard 2 × cp 2 × tp 2
  // Rank 6 sits at dp_shard 1, cp 1, tp 0.
  EXPECT_EQ(m.coord_of(6), coord(0, 0, 1, 0, 1));
  EXPECT_EQ(m.str(), "pp 1 x dp_replicate 1 x dp_shard 2 x cp 2 x tp 2");
  EXPECT_EQ(m.group_ranks(6, MeshGroup::cp), (std::vector<int>{4, 6}));
  EXPECT_EQ(m.group_ranks(6, MeshGroup::tp), (std::vector<int>{6, 7}));
  EXPECT_EQ(m.group_ranks(6, MeshGroup::dp), (std::vector<int>{2, 6}));  // the same sequences go to cp 0 and 1
  EXPECT_EQ(m.group_ranks(6, MeshGroup::dp_shard_cp), (std::vector<int>{0, 2, 4, 6}));
  EXPECT_EQ(m.group_ranks(6, MeshGroup::dp_cp), (std::vector<int>{0, 2, 4, 6}));
  EXPECT_EQ(m.group_rank(6, MeshGroup::dp_shard_cp), 3);  // dp_shard · C + cp
}

TEST(MeshLayout, GroupsOfHsdpWithTp) {
  const MeshLayout m(1, 2, 2, 1, 2);  // dp_replicate 2 × dp_shard 2 × tp 2
  // Rank 6 sits at dp_replicate 1, dp_shard 1, tp 0.
  EXPECT_EQ(m.coord_of(6), coord(0, 1, 1, 0));
  EXPECT_EQ(m.group_ranks(6, MeshGroup::dp), (std::vector<int>{0, 2, 4, 6}));
  EXPECT_EQ(m.group_rank(6, MeshGroup::dp), 3);  // dp_replicate · S + dp_shard
  EXPECT_EQ(m.group_ranks(6, MeshGroup::dp_replicate), (std::vector<int>{2, 6}));
  EXPECT_EQ(m.group_ranks(6, MeshGroup::dp_shard), (std::vector<int>{4, 6}));
  EXPECT_EQ(m.group_ranks(6, MeshGroup::tp), (std::vector<int>{6, 7}));
  EXPECT_EQ(m.group_ranks(3, MeshGroup::dp), (std::vector<int>{1, 3, 5, 7}));
}

// For every layout of 1…12 ranks: each kind of group partitions the world
// into world/size groups of `size` ranks, consistently with group_rank and
// group_index; tp groups are runs of consecutive ranks.
TEST(MeshLayout, GroupsPartitionTheWorld) {
  const MeshGroup kinds[] = {MeshGroup::pp, MeshGroup::dp_replicate, MeshGroup::dp_shard,    MeshGroup::cp,
                             MeshGroup::tp, MeshGroup::dp,           MeshGroup::dp_shard_cp, MeshGroup::dp_cp,
                             MeshGroup::ep, MeshGroup::expert_shard};
  int layouts = 0, with_cp = 0, with_ep = 0;
  for (int n = 1; n <= 12; ++n)
    for (int pp = 1; pp <= n; ++pp)
      for (int rep = 1; rep <= n; ++rep)
        for (int shard = 1; shard <= n; ++shard)
          for (int cp = 1; cp <= n; ++cp)
            for (int tp = 1; tp <= n; ++tp) {
              if (pp * rep * shard * cp * tp != n) continue;
              ++layouts;
              with_cp += cp > 1;
              for (int ep = 1; ep <= n; ++ep) {
                if (ep > 1 && shard % ep != 0 && !(shard == 1 && rep % ep == 0)) continue;
                with_ep += ep > 1;
                const MeshLayout m(pp, rep, shard, cp, tp, ep);
                EXPECT_EQ(m.group_size(MeshGroup::dp), rep * shard);
                // Expert parallelism: ep consecutive dp ranks, and FSDP over the experts' holders.
                EXPECT_EQ(m.group_size(MeshGroup::ep) * m.group_size(MeshGroup::expert_shard),
                          shard % ep == 0 ? shard : ep)
                    << m.str();
                for (int r = 0; r < n; ++r) {
                  const auto ep_ranks = m.group_ranks(r, MeshGroup::ep), dp_ranks = m.group_ranks(r, MeshGroup::dp);
                  const int d = m.group_rank(r, MeshGroup::dp);
                  EXPECT_EQ(ep_ranks,
                            std::vector<int>(dp_ranks.begin() + d / ep * ep, dp_ranks.begin() + d / ep * ep + ep));
                  for (int q : m.group_ranks(r, MeshGroup::expert_shard)) {
                    EXPECT_EQ(m.group_rank(q, MeshGroup::ep), m.group_rank(r, MeshGroup::ep)) << m.str();
                    EXPECT_EQ(m.group_index(q, MeshGroup::dp_shard), m.group_index(r, MeshGroup::dp_shard)) << m.str();
                  }
                }
                EXPECT_EQ(m.group_size(MeshGroup::dp_shard_cp), shard * cp);
                EXPECT_EQ(m.group_size(MeshGroup::dp_cp), rep * shard * cp);
                for (MeshGroup g : kinds) {
                  std::vector<int> seen(static_cast<size_t>(n), 0);
                  std::set<int> indices;
                  for (int r = 0; r < n; ++r) {
                    const auto ranks = m.group_ranks(r, g);
                    ASSERT_EQ(static_cast<int>(ranks.size()), m.group_size(g));
                    EXPECT_EQ(ranks[static_cast<size_t>(m.group_rank(r, g))], r) << m.str();
                    indices.insert(m.group_index(r, g));
                    if (ranks[0] == r)  // count each group once, from its first member
                      for (int q : ranks) ++seen[static_cast<size_t>(q)];
                    if (g == MeshGroup::tp) {
                      for (size_t i = 1; i < ranks.size(); ++i) {
                        EXPECT_EQ(ranks[i], ranks[i - 1] + 1) << m.str();
                      }
                    }
                  }
                  for (int s : seen) {
                    EXPECT_EQ(s, 1) << m.str() << " " << mesh_group_name(g);
                  }
                  EXPECT_EQ(static_cast<int>(indices.size()) * m.group_size(g), n)
                      << m.str() << " " << mesh_group_name(g);
                }
              }
            }
  // Ordered factorisations of n into 5 factors, n = 1..12.
  EXPECT_EQ(layouts, 1 + 5 + 5 + 15 + 5 + 25 + 5 + 35 + 15 + 25 + 5 + 75);
  EXPECT_EQ(with_cp, layouts - (1 + 4 + 4 + 10 + 4 + 16 + 4 + 20 + 10 + 16 + 4 + 40));
  EXPECT_GT(with_ep, 100);
}

// Expert parallelism 2 over FSDP 4 (and 2 replicas): ranks 0 and 1 split the
// experts, ranks 0 and 2 hold the same ones and shard them.
TEST(MeshLayout, GroupsOfExpertParallelOverFsdp) {
  const MeshLayout m(1, 2, 4, 1, 1, 2);
  EXPECT_EQ(m.str(), "pp 1 x dp_replicate 2 x dp_shard 4 x tp 1 x ep 2");
  EXPECT_EQ(m.group_ranks(5, MeshGroup::ep), (std::vector<int>{4, 5}));
  EXPECT_EQ(m.group_ranks(5, MeshGroup::expert_shard), (std::vector<int>{5, 7}));
  EXPECT_EQ(m.group_rank(7, MeshGroup::expert_shard), 1);
  EXPECT_EQ(m.group_ranks(5, MeshGroup::dp_replicate), (std::vector<int>{1, 5}));  // replicas hold the same experts
  // Over DDP (dp_shard 1) the ep group is consecutive replicas, each rank's experts whole on it.
  const MeshLayout ddp(1, 4, 1, 1, 1, 2);
  EXPECT_EQ(ddp.group_ranks(3, MeshGroup::ep), (std::vector<int>{2, 3}));
  EXPECT_EQ(ddp.group_ranks(3, MeshGroup::expert_shard), (std::vector<int>{3}));
  try {
    MeshLayout(1, 1, 4, 1, 1, 3);
    ADD_FAILURE() << "ep 3 over dp_shard 4 was laid out";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expert_parallel_degree 3"), std::string::npos) << e.what();
  }
}

// ---------------------------------------------------------------------------
// Resolving and validating [parallelism]

TEST(MeshLayout, ResolveFillsTheShardDegree) {
  const MeshLayout a = MeshLayout::resolve({2, 1, -1, 2}, 8);
  EXPECT_EQ(a.str(), "pp 2 x dp_replicate 1 x dp_shard 2 x tp 2");
  EXPECT_EQ(MeshLayout::resolve({}, 4).str(), "pp 1 x dp_replicate 1 x dp_shard 4 x tp 1");
  EXPECT_EQ(MeshLayout::resolve({}, 1).world_size(), 1);
  EXPECT_EQ(MeshLayout::resolve({1, 2, 2, 1}, 4).str(), "pp 1 x dp_replicate 2 x dp_shard 2 x tp 1");
  EXPECT_EQ(MeshLayout::resolve({1, 4, -1, 1}, 4).dp_shard(), 1);
  EXPECT_EQ(MeshLayout::resolve({1, 1, -1, 2, 2}, 8).str(), "pp 1 x dp_replicate 1 x dp_shard 2 x cp 2 x tp 2");
  EXPECT_EQ(MeshLayout::resolve({1, 1, -1, 1, 4}, 4).cp(), 4);
}

TEST(MeshLayout, ResolveNamesProductWorldAndKeyToChange) {
  EXPECT_EQ(error_of([] { MeshLayout::resolve({1, 1, 2, 4}, 4); }),
            "[parallelism] degrees multiply to 8 (pipeline_parallel_degree 1 x data_parallel_replicate_degree 1 x "
            "data_parallel_shard_degree 2 x tensor_parallel_degree 4) but the world size is 4 (the ranks mpirun "
            "started); change data_parallel_shard_degree to 1 (or -1 for the ranks the other degrees leave over), or "
            "tensor_parallel_degree to 2, or start 8 ranks");
  // Too few: 2 of 4 ranks used.
  EXPECT_NE(error_of([] { MeshLayout::resolve({1, 1, 2, 1}, 4); })
                .find("degrees multiply to 2 (pipeline_parallel_degree 1 x data_parallel_replicate_degree 1 x "
                      "data_parallel_shard_degree 2 x tensor_parallel_degree 1) but the world size is 4"),
            std::string::npos);
  EXPECT_NE(error_of([] { MeshLayout::resolve({3, 1, 1, 3}, 4); })
                .find("no single degree can be changed to make the product 4: change several so that they multiply "
                      "to 4, or start 9 ranks"),
            std::string::npos);
  EXPECT_EQ(error_of([] { MeshLayout::resolve({1, 1, -1, 3}, 4); }),
            "[parallelism] pipeline_parallel_degree 1 x data_parallel_replicate_degree 1 x tensor_parallel_degree 3 = "
            "3 does not divide the world size 4, so data_parallel_shard_degree = -1 cannot take the ranks left over; "
            "change those degrees so that their product divides 4, or start a multiple of 3 ranks");
  EXPECT_EQ(error_of([] { MeshLayout::resolve({1, 1, -1, 0}, 4); }),
            "[parallelism] tensor_parallel_degree is 0; it must be at least 1");
  EXPECT_EQ(error_of([] { MeshLayout::resolve({1, 1, -2, 1}, 4); }),
            "[parallelism] data_parallel_shard_degree is -2; it must be at least 1, or -1 for the ranks the other "
            "degrees leave over");
  // Absurd degrees from a file: a message, not an overflow.
  EXPECT_NE(error_of([] { MeshLayout::resolve({int64_t{1} << 40, int64_t{1} << 40, 1, 1}, 4); })
                .find("but the world size is 4"),
            std::string::npos);
}

TEST(Validation, TensorParallelMustDivideHeads) {
  check_tensor_parallel_heads(32, 8, 4);
  check_tensor_parallel_heads(32, 8, 8);
  check_tensor_parallel_heads(16, 16, 1);
  EXPECT_EQ(error_of([] { check_tensor_parallel_heads(32, 8, 16); }),
            "[parallelism] tensor_parallel_degree 16 does not divide the model's n_kv_heads 8: tensor parallelism "
            "gives each rank whole key/value heads; degrees that divide both n_heads 32 and n_kv_heads 8: 1, 2, 4, 8");
  EXPECT_EQ(error_of([] { check_tensor_parallel_heads(12, 4, 8); }),
            "[parallelism] tensor_parallel_degree 8 does not divide the model's n_heads 12: tensor parallelism gives "
            "each rank whole attention heads; degrees that divide both n_heads 12 and n_kv_heads 4: 1, 2, 4");
  EXPECT_NE(error_of([] { check_tensor_parallel_heads(6, 6, 4); }).find("1, 2, 3, 6"), std::string::npos);
}

TEST(Validation, GlobalBatchIsLocalTimesDpTimesAccumulation) {
  const MeshLayout m(1, 2, 2, 1, 2);  // dp = 4
  EXPECT_EQ(gradient_accumulation_steps(2, -1, m), 1);
  EXPECT_EQ(gradient_accumulation_steps(2, 8, m), 1);
  EXPECT_EQ(gradient_accumulation_steps(2, 24, m), 3);
  EXPECT_EQ(error_of([&] { gradient_accumulation_steps(2, 20, m); }),
            "training.global_batch_size 20 is not a multiple of training.local_batch_size 2 x the data-parallel "
            "degree 4 (data_parallel_replicate_degree 2 x data_parallel_shard_degree 2) = 8: every data-parallel "
            "rank runs whole local batches, as many as the quotient (the gradient-accumulation steps); use 16 or 24, "
            "or -1 for 8");
  EXPECT_NE(error_of([&] { gradient_accumulation_steps(2, 4, m); }).find("; use 8, or -1 for 8"), std::string::npos);
  EXPECT_NE(error_of([&] { gradient_accumulation_steps(0, 8, m); }).find("training.local_batch_size is 0"),
            std::string::npos);
  // tp and pp ranks share their dp rank's batch: they do not multiply it.
  EXPECT_EQ(gradient_accumulation_steps(4, 8, MeshLayout(2, 1, 1, 1, 4)), 2);
}

// ---------------------------------------------------------------------------
// Config hash

TEST(ConfigCheck, HashIsFnv1a64) {
  // Published FNV-1a 64 test vectors.
  EXPECT_EQ(config_hash(""), 0xcbf29ce484222325ull);
  EXPECT_EQ(config_hash("a"), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(config_hash("foobar"), 0x85944171f73967e8ull);
  EXPECT_NE(config_hash("steps = 10"), config_hash("steps = 11"));
}

TEST(ConfigCheck, MismatchNamesTheRanksThatDiffer) {
  EXPECT_FALSE(config_mismatch({7, 7, 7, 7}).has_value());
  EXPECT_FALSE(config_mismatch({7}).has_value());
  EXPECT_EQ(config_mismatch({7, 7, 9, 7}).value(),
            "the ranks did not all start with the same configuration: rank 2 has configuration hash "
            "0x0000000000000009, where ranks 0-1, 3 have 0x0000000000000007; start every rank with the same config "
            "file and --section.key overrides");
  // A tie: rank 0's hash is taken as the intended one.
  EXPECT_NE(config_mismatch({5, 6, 6, 5}).value().find("ranks 1-2 have configuration hash 0x0000000000000006, where "
                                                       "ranks 0, 3 have 0x0000000000000005"),
            std::string::npos);
  // The majority wins even when rank 0 is the odd one; several odd groups are listed by first rank.
  EXPECT_NE(config_mismatch({1, 2, 2, 2, 3, 2, 3, 2}).value().find(
                "rank 0 has configuration hash 0x0000000000000001; ranks 4, 6 have configuration hash "
                "0x0000000000000003, where ranks 1-3, 5, 7 have 0x0000000000000002"),
            std::string::npos);
}

// ---------------------------------------------------------------------------
// Communication layer pieces that need no MPI

TEST(Comm, ByteFormulas) {
  EXPECT_EQ(comm_bytes(CommOp::all_reduce, 1000, 1), 0u);
  EXPECT_EQ(comm_bytes(CommOp::all_reduce, 1000, 2), 1000u);  // 2·(1/2)·S
  EXPECT_EQ(comm_bytes(CommOp::all_reduce, 1000, 4), 1500u);  // 2·(3/4)·S
  EXPECT_EQ(comm_bytes(CommOp::all_gather, 1000, 4), 750u);
  EXPECT_EQ(comm_bytes(CommOp::reduce_scatter, 1000, 8), 875u);
  EXPECT_EQ(comm_bytes(CommOp::reduce_scatter, 1000, 1), 0u);
  EXPECT_EQ(comm_bytes(CommOp::broadcast, 1000, 4), 1000u);
  EXPECT_EQ(comm_bytes(CommOp::broadcast, 1000, 1), 0u);
  EXPECT_EQ(comm_bytes(CommOp::send, 1000, 4), 1000u);
  EXPECT_EQ(comm_bytes(CommOp::recv, 1000, 4), 1000u);
  // 70B bf16 gradients as fp32 over 1024 ranks: no overflow.
  EXPECT_EQ(comm_bytes(CommOp::all_reduce, uint64_t{280} << 30, 1024), 2 * 1023 * (uint64_t{280} << 30) / 1024);
}

TEST(Comm, ThreadLevelBelowFunneledIsRefused) {
  check_thread_level(MPI_THREAD_FUNNELED, MPI_THREAD_FUNNELED);
  check_thread_level(MPI_THREAD_MULTIPLE, MPI_THREAD_FUNNELED);
  EXPECT_EQ(error_of([] { check_thread_level(MPI_THREAD_SINGLE, MPI_THREAD_FUNNELED); }),
            "MPI provides thread level MPI_THREAD_SINGLE but Anvil needs MPI_THREAD_FUNNELED (its data-prefetch and "
            "checkpoint threads run while the main thread calls MPI); use an MPI library built with thread support");
  EXPECT_EQ(MpiRuntime::kRequiredThreadLevel, MPI_THREAD_FUNNELED);
}

TEST(Comm, AbortAllWithoutMpiExitsWithTheMessage) {
  EXPECT_EXIT(abort_all("the reason"), ::testing::ExitedWithCode(1), "anvil: rank 0: the reason");
}

TEST(Comm, CommunicatorNeedsMpi) {
  EXPECT_NE(error_of([] { Communicator::world(); }).find("MPI is not running"), std::string::npos);
  Communicator none;
  EXPECT_FALSE(none.valid());
}

// ---------------------------------------------------------------------------
// Under mpirun: tests/comm_worker.cpp

namespace {

struct CommandRun {
  int exit_code;
  std::string output;
  double seconds;
};

// A command's exit code (124: killed by `timeout`), its stdout and stderr, and
// its wall time. OpenMPI refuses root without the two variables; the workers
// get one OpenMP thread each, since 4 ranks share this machine's cores.
CommandRun run(const std::string& command) {
  const std::string cmd =
      "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 " + command + " 2>&1";
  const auto start = std::chrono::steady_clock::now();
  CommandRun out{-1, "", 0};
  FILE* p = popen(cmd.c_str(), "r");
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.output.append(buf, n);
  const int status = pclose(p);
  out.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return out;
}

// `timeout` turns a hang into exit code 124 rather than a stuck ctest.
std::string mpirun(int ranks, const std::string& args, int timeout_s = 120) {
  return "timeout -k 5 " + std::to_string(timeout_s) + " " + ANVIL_MPIEXEC + " --oversubscribe -np " +
         std::to_string(ranks) + " " + ANVIL_COMM_WORKER + " --gtest_color=no " + args;
}

// The worker's tests all pass: exit 0, GoogleTest's summary with exactly
// `passed` tests passed and `skipped` skipped (those that need more ranks than
// the world has), no failure lines.
void expect_worker_passes(const CommandRun& r, int passed, int skipped) {
  EXPECT_EQ(r.exit_code, 0) << r.output;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.output, m, std::regex(R"(\[  PASSED  \] (\d+) tests?\.)"))) << r.output;
  EXPECT_EQ(std::stoi(m[1]), passed) << r.output;
  if (skipped == 0) {
    EXPECT_EQ(r.output.find("[  SKIPPED ]"), std::string::npos) << r.output;
  } else {
    ASSERT_TRUE(std::regex_search(r.output, m, std::regex(R"(\[  SKIPPED \] (\d+) tests?, listed below)"))) << r.output;
    EXPECT_EQ(std::stoi(m[1]), skipped) << r.output;
  }
  EXPECT_EQ(r.output.find("FAILED"), std::string::npos) << r.output;
  std::printf("(%.1f s)\n", r.seconds);
}

int count(const std::string& text, const std::string& what) {
  int c = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++c;
  return c;
}

}  // namespace

// The worker holds 19 tests: all run on 4 ranks; the bf16 pairwise-defeat
// patterns need 4, so 2 ranks skip that one; one rank also skips the two
// send/receive tests, which need a peer.
TEST(MultiRank, FourRanks) { expect_worker_passes(run(mpirun(4, "--expect-world-size=4")), 19, 0); }

TEST(MultiRank, TwoRanks) { expect_worker_passes(run(mpirun(2, "--expect-world-size=2")), 18, 1); }

// Started without mpirun, MPI runs as a singleton: a world of one rank.
TEST(MultiRank, SingletonWithoutMpirun) {
  expect_worker_passes(
      run(std::string("timeout -k 5 120 ") + ANVIL_COMM_WORKER + " --gtest_color=no --expect-world-size=1"), 16, 3);
}

TEST(MultiRank, ConfigMismatchStopsEveryRankWithOneMessage) {
  const CommandRun r = run(mpirun(4, "--scenario=config-mismatch", 60));
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.exit_code, 124) << "timed out\n" << r.output;
  const std::string msg =
      ": the ranks did not all start with the same configuration: rank 2 has configuration hash 0x" +
      [] {
        char h[17];
        std::snprintf(h, sizeof h, "%016llx", static_cast<unsigned long long>(config_hash("[training]\nsteps = 11\n")));
        return std::string(h);
      }() +
      ", where ranks 0-1, 3 have 0x";
  for (int rank = 0; rank < 4; ++rank)
    EXPECT_EQ(count(r.output, "anvil: rank " + std::to_string(rank) + msg), 1) << r.output;
  EXPECT_EQ(r.output.find("configurations agree"), std::string::npos) << r.output;
}

TEST(MultiRank, AbortAllEndsTheJobNamingTheRank) {
  const CommandRun r = run(mpirun(4, "--scenario=abort", 30));
  EXPECT_NE(r.exit_code, 124) << "mpirun hung until the timeout killed it\n" << r.output;
  EXPECT_NE(r.exit_code, 0) << r.output;
  // The line names the rank and the host it runs on (this one's name, as MPI gives it).
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  EXPECT_NE(
      r.output.find(std::string("anvil: rank 2 (host ") + host + "): simulated failure (comm_worker --scenario=abort)"),
      std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("completed, which it must not"), std::string::npos) << r.output;
  std::printf("mpirun ended %.1f s after start\n", r.seconds);
}
