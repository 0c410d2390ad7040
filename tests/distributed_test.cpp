// Data parallelism through the trainer under mpirun: every data-parallel row
// of the layout table (tests/layout_parity.h: DDP 2, FSDP 2, FSDP 4, HSDP 2x2,
// FSDP 2 with 4 accumulation steps, each under AC none, full and selective op)
// against the single-process run, with the bounds and reasoning given there;
// FSDP's memory per rank; checkpoints moving between layouts; faults and
// Ctrl-C; bytes moved against their closed forms; bf16 tolerances.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "anvil/model/args.h"
#include "anvil/model/llama.h"
#include "anvil/model/params.h"
#include "anvil/train/checkpoint_folder.h"
#include "layout_parity.h"
#include "test_util.h"

namespace fs = std::filesystem;

namespace {

using Output = anvil::testing::CommandOutput;
using anvil::testing::layout;
using anvil::testing::runs;

fs::path workdir() { return runs().dir(); }

}  // namespace

using anvil::testing::LayoutParity;
TEST_P(LayoutParity, MatchesSingleProcess) { anvil::testing::expect_matches_single_process(GetParam()); }
INSTANTIATE_TEST_SUITE_P(DataParallel, LayoutParity,
                         ::testing::ValuesIn(anvil::testing::parity_cases([](const anvil::testing::Layout& l) {
                           return l.ranks > 1 && l.tp == 1 && l.pp == 1 && l.cp == 1;
                         })),
                         anvil::testing::parity_case_name);

// ZeRO-3's closed form: with N shards each rank keeps 1/N of the fp32 master
// weights and their bf16 copy (6 bytes per parameter), of the fp32 gradients
// (4) and of AdamW's two fp32 moments (8), plus the padding that rounds each
// group's shard up to 32 elements — read from the allocator's categories right
// after the optimizer step, within 1%. One process keeps no bf16 copy (each
// block's is cast while it runs and gone by then): 4 bytes of weights.
TEST(Distributed, FsdpRanksKeepOneShardOfWeightsGradientsAndOptimizerState) {
  const double params = static_cast<double>(anvil::model_flavor("llama3", "debugmodel").num_params());
  for (int n : {1, 2, 4}) {
    SCOPED_TRACE("FSDP " + std::to_string(n));
    const std::string dump = "memory_fsdp" + std::to_string(n);
    const std::string flags = "--training.local_batch_size 2 --training.steps 2 --training.mixed_precision_param bfloat16";
    const Output out = n == 1 ? runs().single(dump, flags) : runs().mpi(n, dump, flags);
    ASSERT_EQ(out.exit_code, 0) << out.text;
    std::ifstream in(workdir() / dump / "metrics.jsonl");
    nlohmann::json last;
    for (std::string line; std::getline(in, line);) last = nlohmann::json::parse(line);
    const auto& live = last.at("live_bytes_after_optimizer_by_category");
    const struct {
      const char* category;
      double bytes_per_param;
    } expected[] = {{"parameters", n == 1 ? 4.0 : 6.0}, {"gradients", 4}, {"optimizer_state", 8}};
    for (const auto& e : expected) {
      const double want = e.bytes_per_param * params / n;
      const double got = live.at(e.category).get<double>();
      EXPECT_GE(got, want) << e.category;
      EXPECT_LE(got, want * 1.01) << e.category;
      std::printf("FSDP %d: %-15s %12.0f bytes per rank, closed form %12.0f (+%.3f%%)\n", n, e.category, got, want,
                  100 * (got / want - 1));
    }
  }
}

namespace {
// Resumes a copy of `saved`'s checkpoints under `ranks` ranks with `flags`
// (dump folder `dump`): it must resume from step 5 and reach `want`'s losses
// at steps 6-10 within 1e-5 relative. `worst`: the largest difference.
void expect_resumes_to(const std::string& saved, const std::string& dump, int ranks, const std::string& flags,
                       const std::map<int64_t, double>& want, double& worst) {
  fs::remove_all(workdir() / dump);
  fs::create_directories(workdir() / dump);
  fs::copy(workdir() / saved / "checkpoint", workdir() / dump / "checkpoint", fs::copy_options::recursive);
  const Output out = ranks == 1 ? runs().run(layout("single"), dump, flags) : runs().mpi(ranks, dump, flags);
  ASSERT_EQ(out.exit_code, 0) << out.text;
  EXPECT_NE(out.text.find("resumed from " + (workdir() / dump / "checkpoint" / "step-5").string()), std::string::npos)
      << out.text;
  const auto got = runs().losses(dump);
  ASSERT_EQ(got.size(), 5u) << out.text;
  worst = 0;
  for (const auto& [step, loss] : got) {
    ASSERT_GE(step, 6);
    const double rel = std::abs(loss - want.at(step)) / std::abs(want.at(step));
    worst = std::max(worst, rel);
    EXPECT_LE(rel, 1e-5) << "step " << step;
  }
}
}  // namespace

// A checkpoint holds global tensors and rank 0's data position, so a run saved
// under FSDP 2 continues under another layout: a single process, FSDP 4 and
// DDP 2 each resume from its step 5 and reach the losses of the uninterrupted
// FSDP 2 run.
TEST(Distributed, CheckpointsMoveBetweenLayouts) {
  // A constant learning rate after warm-up, so stopping at step 5 changes nothing before it.
  const std::string batch = "--training.global_batch_size 4 --lr_scheduler.decay_ratio 0 ";
  const Output whole = runs().mpi(2, "xl_whole", batch + "--training.local_batch_size 2");
  ASSERT_EQ(whole.exit_code, 0) << whole.text;
  const Output saved =
      runs().mpi(2, "xl_saved", batch + "--training.local_batch_size 2 --checkpoint.interval 5 --training.steps 5");
  ASSERT_EQ(saved.exit_code, 0) << saved.text;
  const auto want = runs().losses("xl_whole");
  ASSERT_EQ(want.size(), 10u);
  for (const char* target : {"single", "fsdp4", "ddp2"}) {
    const anvil::testing::Layout& t = layout(target);
    SCOPED_TRACE(t.name);
    // The same 4 sequences per step, split over the layout's data-parallel ranks.
    double worst = 0;
    expect_resumes_to("xl_saved", "xl_to_" + t.name, t.ranks,
                      batch + "--training.local_batch_size " + std::to_string(4 / t.dp) + " " + t.flags, want, worst);
    std::printf("FSDP 2 checkpoint resumed as %-6s: worst loss difference %.2e over steps 6-10\n", t.name.c_str(), worst);
  }
}

// Muon's checkpoint holds every matrix's momentum_buffer whole, whatever the
// layout's runs of it: saved at step 5 under FSDP 2, it resumes on one
// process, under FSDP 4 (other runs, other owners), in 2 pipeline stages
// (each stage's matrices whole) and under TP 2 (each rank half of every
// matrix), each reaching the uninterrupted run's losses.
TEST(Distributed, MuonCheckpointsMoveBetweenLayouts) {
  const std::string batch = "--training.global_batch_size 4 --lr_scheduler.decay_ratio 0 " + anvil::testing::kMuon + " ";
  const Output whole = runs().mpi(2, "muon_xl_whole", batch + "--training.local_batch_size 2");
  ASSERT_EQ(whole.exit_code, 0) << whole.text;
  const Output saved = runs().mpi(
      2, "muon_xl_saved", batch + "--training.local_batch_size 2 --checkpoint.interval 5 --training.steps 5");
  ASSERT_EQ(saved.exit_code, 0) << saved.text;
  const auto want = runs().losses("muon_xl_whole");
  ASSERT_EQ(want.size(), 10u);
  for (const char* target : {"single", "fsdp4", "pp2_1f1b", "tp2"}) {
    const anvil::testing::Layout& t = layout(target);
    SCOPED_TRACE(t.name);
    double worst = 0;
    expect_resumes_to("muon_xl_saved", "muon_xl_to_" + t.name, t.ranks,
                      batch + "--training.local_batch_size " + std::to_string(4 / t.dp) + " " + t.flags, want, worst);
    std::printf("Muon FSDP 2 checkpoint resumed as %-8s: worst loss difference %.2e over steps 6-10\n", t.name.c_str(),
                worst);
  }
}

namespace {
// The auxiliary-loss-free balance's expert biases, (n_layers·E), that a run's
// checkpoint of `step` holds (state.json's model_state); none, and a failure
// saying why, when it holds none, so that the other layouts still run.
std::vector<float> expert_biases(const std::string& dump, int step) {
  try {
    const nlohmann::json state =
        anvil::read_checkpoint_state(workdir() / dump / "checkpoint" / ("step-" + std::to_string(step)));
    return state.at("model_state").at("expert_bias").get<std::vector<float>>();
  } catch (const std::exception& e) {
    ADD_FAILURE() << dump << "'s step " << step << ": " << e.what();
    return {};
  }
}
}  // namespace

// A mixture of experts' checkpoint holds every expert whole however the
// experts were split, and the experts' biases of the auxiliary-loss-free
// balance: saved at step 5 under expert parallelism 2 over FSDP 4 (each rank
// holding half of 4 experts), it resumes on one process, under EP 2 over DDP 2,
// under EP 2 over FSDP 2, under EP 2 over DDP 2 with TP 2 (each rank half of
// its experts' width), in 2 pipeline stages (each routing its own layers)
// and under CP 2 (each rank 2 of the 4 chunks of every sequence, with every
// expert), each reaching the uninterrupted run's losses. The biases come back:
// steps 6-10 route every layer's tokens to the experts the uninterrupted run
// chose, and the step-10 checkpoint holds its biases to the bit (the rule
// moves them by the signs of whole route counts, so the same routes move them
// alike whatever the layout).
TEST(Distributed, MoeCheckpointsMoveBetweenExpertLayouts) {
  const std::string batch =
      "--model.name qwen3 --model.flavor debugmodel_moe --model.router_aux_loss_coef 0.01 "
      "--model.moe_score_function sigmoid --model.moe_bias_update_rate 0.01 "
      "--training.global_batch_size 4 --lr_scheduler.decay_ratio 0 ";
  const std::string ep4 =
      "--parallelism.data_parallel_shard_degree 4 --parallelism.expert_parallel_degree 2 "
      "--training.local_batch_size 1 ";
  const Output whole = runs().mpi(4, "moe_xl_whole", batch + ep4);
  ASSERT_EQ(whole.exit_code, 0) << whole.text;
  const Output saved = runs().mpi(4, "moe_xl_saved", batch + ep4 + "--checkpoint.interval 5 --training.steps 5");
  ASSERT_EQ(saved.exit_code, 0) << saved.text;
  const auto want = runs().losses("moe_xl_whole");
  ASSERT_EQ(want.size(), 10u);
  // What the resumes start from: the uninterrupted run's biases at step 5,
  // moved off zero, so a resume that dropped them would start elsewhere.
  const anvil::ModelArgs moe = anvil::model_flavor("qwen3", "debugmodel_moe");
  const std::vector<float> saved_biases = expert_biases("moe_xl_saved", 5);
  ASSERT_EQ(saved_biases.size(), static_cast<size_t>(moe.n_layers * moe.num_experts));
  EXPECT_EQ(saved_biases, expert_biases("moe_xl_whole", 5));
  EXPECT_TRUE(std::any_of(saved_biases.begin(), saved_biases.end(), [](float b) { return b != 0; }));
  const std::vector<float> want_biases = expert_biases("moe_xl_whole", 10);
  const auto want_routes = runs().routes_by_layer("moe_xl_whole");
  ASSERT_EQ(want_routes.size(), 10u);
  const struct {
    const char* name;
    int ranks;
    std::string flags;
  } targets[] = {{"single", 1, "--training.local_batch_size 4"},
                 {"ep2_ddp2", 2,
                  "--training.local_batch_size 2 --parallelism.data_parallel_replicate_degree 2 "
                  "--parallelism.data_parallel_shard_degree 1 --parallelism.expert_parallel_degree 2"},
                 {"ep2_fsdp2", 2,
                  "--training.local_batch_size 2 --parallelism.data_parallel_shard_degree 2 "
                  "--parallelism.expert_parallel_degree 2"},
                 {"ep2_ddp2_tp2", 4,
                  "--training.local_batch_size 2 --parallelism.data_parallel_replicate_degree 2 "
                  "--parallelism.data_parallel_shard_degree 1 --parallelism.expert_parallel_degree 2 "
                  "--parallelism.tensor_parallel_degree 2"},
                 // Each stage routes its own layers; the routes summed over the stages move every layer's biases.
                 {"pp2", 2, "--training.local_batch_size 4 " + layout("pp2_1f1b").flags},
                 // Each rank routes its chunks; the routes summed over both move the biases (seq_len 32 in 4 chunks).
                 {"cp2", 2, "--training.local_batch_size 4 " + layout("cp2").flags}};
  for (const auto& t : targets) {
    SCOPED_TRACE(t.name);
    const std::string dump = std::string("moe_xl_to_") + t.name;
    double worst = 0;
    expect_resumes_to("moe_xl_saved", dump, t.ranks, batch + t.flags, want, worst);
    std::printf("EP 2 x FSDP 4 MoE checkpoint resumed as %-12s: worst loss difference %.2e over steps 6-10\n", t.name,
                worst);
    const auto routes = runs().routes_by_layer(dump);
    for (int64_t step = 6; step <= 10; ++step) {
      const auto got = routes.find(step);
      if (got == routes.end()) {
        ADD_FAILURE() << "no moe_routes_by_layer at step " << step;
        continue;
      }
      EXPECT_EQ(got->second, want_routes.at(step)) << "step " << step;
    }
    EXPECT_EQ(expert_biases(dump, 10), want_biases);
  }
}

// When a rank dies mid-step the others must not wait forever in their next
// collective: the job ends with a message naming the rank. mpirun_prefix's
// `timeout` turns a hang into exit code 124, which the test refuses.
TEST(Distributed, ARankKilledMidStepEndsTheJobNamingIt) {
  const Output out = runs().mpi(2, "killed", "--training.local_batch_size 2", "ANVIL_FAULT_KILL_RANK=1:3 ");
  EXPECT_NE(out.exit_code, 0) << out.text;
  EXPECT_NE(out.exit_code, 124) << "the job hung:\n" << out.text;
  EXPECT_NE(out.text.find("rank 1"), std::string::npos) << out.text;
  EXPECT_EQ(out.text.find("anvil: done"), std::string::npos) << out.text;
}

// A rank that hangs without dying (SIGSTOP in step 7, after the checkpoint of
// step 5) leaves the other waiting in the step's gradient all-reduce: its
// deadline ends the job, with one line naming the step, the operation, the
// group, the silent rank and its host, and the checkpoint to resume from.
// Running the same command again resumes there, and steps 6-10 equal an
// uninterrupted run's.
TEST(Distributed, AHungRankEndsTheJobAtTheDeadlineAndTheRunResumes) {
  // Only the run that hangs gets the short deadline: the comparison runs are
  // two oversubscribed ranks on a busy machine, and keep the default.
  const std::string flags = "--training.local_batch_size 2";
  const Output hung = runs().mpi(2, "hung", flags + " --comm.train_timeout_seconds 3", "ANVIL_FAULT_STALL_RANK=1:7 ");
  EXPECT_NE(hung.exit_code, 0) << hung.text;
  EXPECT_NE(hung.exit_code, 124) << "the job hung:\n" << hung.text;
  for (const char* want : {"anvil: rank 0 (host ", "error: in step 7, all_reduce (MPI_Allreduce)", "over the dp group",
                           "did not complete within 3 s (comm.train_timeout_seconds): no word from rank 1 (host ",
                           "last complete checkpoint ", "checkpoint/step-5; to resume from it, run the same command"})
    EXPECT_NE(hung.text.find(want), std::string::npos) << "missing '" << want << "' in:\n" << hung.text;
  EXPECT_EQ(hung.text.find("anvil: done"), std::string::npos) << hung.text;

  const Output resumed = runs().mpi(2, "hung", flags);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.text;
  EXPECT_NE(resumed.text.find("resumed from"), std::string::npos) << resumed.text;
  const Output whole = runs().mpi(2, "not_hung", flags);
  ASSERT_EQ(whole.exit_code, 0) << whole.text;
  const auto want = runs().losses("not_hung");
  const auto got = runs().losses("hung");
  for (int64_t step = 6; step <= 10; ++step) {
    ASSERT_TRUE(got.count(step) && want.count(step)) << "step " << step;
    EXPECT_EQ(got.at(step), want.at(step)) << "step " << step;
  }
}

// Ctrl-C under mpirun. A terminal's Ctrl-C reaches mpirun only (OpenMPI puts
// each rank in its own process group), and mpirun relays it as SIGTERM to every
// rank, SIGKILL following after odls_base_sigkill_timeout seconds; a scheduler
// or a user may instead signal the ranks themselves, at different moments.
// (mpirun sends SIGCONT, waits that timeout, sends SIGTERM, waits, SIGKILLs.)
// Either way every rank must stop after the same micro-batch (they agree at each
// micro-batch boundary) and the job must end without hanging. Returns the
// job's exit code and output, the ranks' "stopped ..." lines by rank.
struct Interrupted {
  int exit_code = -1;
  std::string text;
  std::map<int, std::string> stopped_by_rank;
};
Interrupted interrupt_a_run(const std::string& dump, const std::string& target, const std::string& mpirun_flags) {
  const fs::path dir = workdir() / dump, log = workdir() / (dump + ".log");
  fs::remove_all(dir);
  // 4 micro-batches per step (2 sequences each on 2 ranks, 16 per step), so a
  // signal usually lands inside a step.
  const std::string train = std::string(ANVIL_BINARY) + " " +
                            runs().args(dump, "--training.local_batch_size 2 --training.global_batch_size 16 "
                                              "--checkpoint.enable false --training.steps 100000");
  const std::string script =
      "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 timeout -k 5 300 mpirun " +
      mpirun_flags + " --oversubscribe --bind-to none -np 2 " + train + " > " + log.string() +
      " 2>&1 &\n"
      "T=$!\n"
      // Training is under way once two steps are logged.
      "for i in $(seq 1200); do [ \"$(cat " + (dir / "metrics.jsonl").string() +
      " 2>/dev/null | wc -l)\" -ge 2 ] && break; sleep 0.1; done\n"
      "MP=$(pgrep -P $T -x mpirun)\n"
      "RANK1=$(for p in $(pgrep -P $MP); do tr '\\0' '\\n' < /proc/$p/environ | grep -qx OMPI_COMM_WORLD_RANK=1 && "
      "echo $p; done)\n"
      "kill -INT " + target + "\n"
      "wait $T\n"
      "exit $?\n";
  const fs::path script_path = workdir() / (dump + ".sh");
  std::ofstream(script_path) << script;
  const int status = std::system(("bash " + script_path.string()).c_str());
  Interrupted r;
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  std::ifstream in(log);
  for (std::string line; std::getline(in, line);) {
    r.text += line + "\n";
    int rank = -1;
    char rest[256] = {};
    if (std::sscanf(line.c_str(), "anvil: rank %d: stopped %255[^\n]", &rank, rest) == 2) r.stopped_by_rank[rank] = rest;
  }
  return r;
}

TEST(Distributed, CtrlCToOneRankStopsEveryRankAfterTheSameMicroBatch) {
  const Interrupted r = interrupt_a_run("sigint_rank1", "$RANK1", "");
  EXPECT_NE(r.exit_code, 124) << "the job hung:\n" << r.text;
  EXPECT_EQ(r.exit_code, 130) << r.text;  // mpirun passes on the ranks' 130
  ASSERT_EQ(r.stopped_by_rank.size(), 2u) << r.text;
  EXPECT_EQ(r.stopped_by_rank.at(0), r.stopped_by_rank.at(1)) << r.text;
  EXPECT_NE(r.text.find("anvil: interrupted (Interrupt)"), std::string::npos) << r.text;
  EXPECT_EQ(r.text.find("anvil: done"), std::string::npos) << r.text;
  std::printf("SIGINT to rank 1: both ranks stopped %s; exit %d\n", r.stopped_by_rank.at(0).c_str(), r.exit_code);
}

TEST(Distributed, CtrlCToMpirunStopsEveryRankAfterTheSameMicroBatch) {
  // mpirun's default grace between SIGTERM and SIGKILL, 1 s, is ample for
  // these millisecond micro-batches (docs/distributed.md for longer ones).
  const Interrupted r = interrupt_a_run("sigint_mpirun", "$MP", "");
  EXPECT_NE(r.exit_code, 124) << "the job hung:\n" << r.text;
  EXPECT_NE(r.exit_code, 0) << r.text;  // mpirun's own code after it was interrupted (1 in OpenMPI 4.1)
  ASSERT_EQ(r.stopped_by_rank.size(), 2u) << r.text;
  EXPECT_EQ(r.stopped_by_rank.at(0), r.stopped_by_rank.at(1)) << r.text;
  EXPECT_NE(r.text.find("anvil: interrupted (Terminated)"), std::string::npos) << r.text;
  std::printf("SIGINT to mpirun: both ranks stopped %s; exit %d\n", r.stopped_by_rank.at(0).c_str(), r.exit_code);
}

// A bad data file stops every rank with the file named, and no hang.
TEST(Distributed, ABadDataFileStopsTheJobNamingTheFile) {
  const fs::path shards = workdir() / "bad_shards";
  fs::remove_all(shards);
  const Output made = anvil::testing::run_anvil("tokenize --input " + (workdir() / "text.txt").string() +
                                                " --output-dir " + shards.string() + " --shard-tokens 4000");
  ASSERT_EQ(made.exit_code, 0) << made.text;
  fs::path victim;
  for (const auto& e : fs::directory_iterator(shards))
    if (e.path().extension() == ".shard") victim = std::max(victim, e.path());
  ASSERT_FALSE(victim.empty());
  {
    std::fstream f(victim, std::ios::in | std::ios::out | std::ios::binary);
    f.write("BAD!", 4);  // the shard's magic
  }
  const Output out = runs().mpi(2, "bad_data",
                             "--training.local_batch_size 2 --training.dataset shards --training.dataset_path " +
                                 shards.string());
  EXPECT_NE(out.exit_code, 0) << out.text;
  EXPECT_NE(out.exit_code, 124) << "the job hung:\n" << out.text;
  EXPECT_NE(out.text.find(victim.filename().string()), std::string::npos) << out.text;
  EXPECT_NE(out.text.find("anvil: rank "), std::string::npos) << out.text;
}

namespace {

// The bytes one rank sends per step, by the algorithm-independent formulas
// (all-reduce 2(n−1)/n·S, all-gather and reduce-scatter (n−1)/n·S of the full
// tensor), for the model's parameter groups.
struct GroupSizes {
  std::vector<int64_t> padded;  // each group's elements in the flat buffers
  int64_t total = 0;
};
GroupSizes group_sizes() {
  const anvil::ParamStore store(anvil::llama_param_specs(anvil::model_flavor("llama3", "debugmodel")),
                                anvil::DType::f32, /*allocate=*/false);
  GroupSizes g;
  for (const auto& pg : store.groups()) g.padded.push_back(pg.numel), g.total += pg.numel;
  return g;
}

double last_metric(const std::string& dump, const char* key) {
  std::ifstream in(workdir() / dump / "metrics.jsonl");
  double v = -1;
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j.contains(key)) v = j[key].get<double>();
  }
  return v;
}

}  // namespace

TEST(Distributed, BytesMovedMatchTheClosedFormsAndTheTraceShowsThem) {
  const GroupSizes g = group_sizes();
  const int n = 2;
  const double f = static_cast<double>(n - 1) / n;
  // DDP: every group's fp32 gradients all-reduced once per step.
  {
    const Output out =
        runs().mpi(n, "bytes_ddp", "--training.local_batch_size 2 --training.steps 2 " + layout("ddp2").flags);
    ASSERT_EQ(out.exit_code, 0) << out.text;
    const double want = 2 * f * 4.0 * static_cast<double>(g.total);
    EXPECT_EQ(last_metric("bytes_ddp", "comm_bytes_per_step"), want);
    EXPECT_EQ(last_metric("bytes_ddp", "comm_bytes_closed_form"), want);
    std::printf("DDP 2: %.0f bytes per step per rank, closed form 2(n-1)/n x 4 x P = %.0f\n",
                last_metric("bytes_ddp", "comm_bytes_per_step"), want);
  }
  // FSDP, bf16 weights: each group gathered for its forward and again for its
  // backward, except the last block (kept by the default reshard policy) and
  // the head (its forward and backward are one pass); every group's fp32
  // gradients reduce-scattered once.
  {
    const Output out = runs().mpi(n, "bytes_fsdp",
                               "--training.local_batch_size 2 --training.steps 2 --training.mixed_precision_param bfloat16"
                               " --profiling.enable_profiling --profiling.profile_freq 2");
    ASSERT_EQ(out.exit_code, 0) << out.text;
    const size_t groups = g.padded.size();
    double gathered = 0, reduced = 0;
    for (size_t i = 0; i < groups; ++i) {
      const int64_t per_rank = ((g.padded[i] + n - 1) / n + 31) / 32 * 32;
      const double full = static_cast<double>(n * per_rank);
      const bool regathered = i + 2 < groups;  // not the last block, not the head
      gathered += full * (regathered ? 2 : 1);
      reduced += full;
    }
    const double want = f * (2.0 * gathered + 4.0 * reduced);
    EXPECT_EQ(last_metric("bytes_fsdp", "comm_bytes_per_step"), want);
    EXPECT_EQ(last_metric("bytes_fsdp", "comm_bytes_closed_form"), want);
    std::printf("FSDP 2: %.0f bytes per step per rank, closed form %.0f\n", last_metric("bytes_fsdp", "comm_bytes_per_step"),
                want);
    // The profiled step's collectives appear on their own track, with bytes and bandwidth.
    std::ifstream in(workdir() / "bytes_fsdp" / "profile_traces" / "step-2.trace.json");
    const nlohmann::json trace = nlohmann::json::parse(in);
    int track = -1, gathers = 0, scatters = 0;
    for (const auto& e : trace.at("traceEvents"))
      if (e.at("ph") == "M" && e.at("name") == "thread_name" && e.at("args").at("name") == "collectives in flight")
        track = e.at("tid").get<int>();
    ASSERT_GE(track, 0);
    for (const auto& e : trace.at("traceEvents")) {
      if (e.at("ph") != "X" || e.at("tid").get<int>() != track) continue;
      EXPECT_EQ(e.at("cat"), "communication");
      EXPECT_GT(e.at("args").at("bytes").get<double>(), 0);
      EXPECT_GT(e.at("args").at("GB/s").get<double>(), 0);
      const std::string name = e.at("name");
      gathers += name.find("fsdp.all_gather") != std::string::npos;
      scatters += name.find("fsdp.reduce_scatter") != std::string::npos;
    }
    EXPECT_EQ(gathers, static_cast<int>(2 * groups - 2));
    EXPECT_EQ(scatters, static_cast<int>(groups));
  }
}

// The trainer's closed form (distributed/comm_volume.h) against the traffic it
// measures, for HSDP, for FSDP with gradient accumulation, and for FSDP under
// expert parallelism (each block's experts gathered and reduced over the ranks
// holding them: none but the rank itself over 2 ranks, 2 ranks over 4).
TEST(Distributed, ClosedFormTrafficHoldsForHsdpAndAccumulation) {
  const std::string ep =
      "--model.name qwen3 --model.flavor debugmodel_moe --model.moe_routing balanced "
      "--parallelism.expert_parallel_degree 2 --training.local_batch_size 1 ";
  const struct {
    const char* dump;
    int ranks;
    std::string flags;
  } cases[] = {{"bytes_hsdp", 4, "--training.local_batch_size 1 " + layout("hsdp2x2").flags},
               {"bytes_accum", 2, "--training.local_batch_size 1 --training.global_batch_size 6"},
               {"bytes_never", 2, "--training.local_batch_size 1 --parallelism.fsdp_reshard_after_forward never"},
               {"bytes_ep_fsdp2", 2, ep},
               {"bytes_ep_fsdp4", 4, ep + "--parallelism.data_parallel_shard_degree 4"}};
  for (const auto& r : cases) {
    SCOPED_TRACE(r.dump);
    const Output out = runs().mpi(r.ranks, r.dump, "--training.steps 2 " + r.flags);
    ASSERT_EQ(out.exit_code, 0) << out.text;
    const double measured = last_metric(r.dump, "comm_bytes_per_step");
    EXPECT_GT(measured, 0);
    EXPECT_EQ(measured, last_metric(r.dump, "comm_bytes_closed_form"));
    std::printf("%-12s %.0f bytes per step per rank (closed form %.0f)\n", r.dump, measured,
                last_metric(r.dump, "comm_bytes_closed_form"));
  }
}

// bf16: the layouts compute each sequence's forward and backward as the single
// process does, but sum the fp32 weight gradients over ranks in another order,
// so an update can land on the other side of a bf16 rounding of the compute
// weights. One bf16 ulp is 2^-8 relative (3.9e-3) on a weight, but only the
// few weights whose update falls near a rounding boundary flip, and a loss
// averages thousands of products, so it moves by far less than an ulp. Bound:
// 5e-4 relative per step over 10 steps, an eighth of one bf16 ulp of the loss
// itself — what a layout bug (a wrong shard, a token counted twice) would
// exceed at once, as the fp32 tests show by how far inside 1e-5 they stay.
TEST(Distributed, Bf16LayoutsStayWithinTheirToleranceOfTheSingleProcess) {
  // Each layout takes 4 sequences per step (16 with 4 accumulation steps), split
  // over its data-parallel ranks; the single process takes them at once.
  const struct {
    const char* layout;
    int accumulation;
  } cases[] = {{"ddp2", 1}, {"fsdp2", 1}, {"fsdp4", 1}, {"hsdp2x2", 1}, {"tp4", 1}, {"fsdp2_tp2", 1}, {"fsdp2", 4}};
  for (const auto& c : cases) anvil::testing::expect_bf16_within(layout(c.layout), c.accumulation, 5e-4);
}

// Tensor-parallel collectives appear in a profiled step's trace with their bytes.
TEST(Distributed, TensorParallelCollectivesAreTracedWithTheirBytes) {
  const Output out = runs().mpi(2, "tp_trace",
                                "--training.local_batch_size 2 --training.steps 1 --profiling.enable_profiling " +
                                    layout("tp2").flags + " --parallelism.data_parallel_shard_degree 1");
  ASSERT_EQ(out.exit_code, 0) << out.text;
  std::ifstream in(workdir() / "tp_trace" / "profile_traces" / "step-1.trace.json");
  const nlohmann::json trace = nlohmann::json::parse(in);
  std::map<std::string, int> spans;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.at("ph") != "X" || e.at("cat") != "communication") continue;
    const std::string name = e.at("name");
    if (name.rfind("tp.", 0) != 0) continue;
    ++spans[name];
    EXPECT_GT(e.at("args").at("bytes").get<double>(), 0) << name;
  }
  // Sequence parallel: per block an all-gather before attention and the MLP, a reduce-scatter after each.
  EXPECT_GE(spans["tp.all_gather"], 12) << trace.dump().substr(0, 300);
  EXPECT_GE(spans["tp.reduce_scatter"], 12);
}
