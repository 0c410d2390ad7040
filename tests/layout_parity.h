// The layout-parity harness of distributed_test and tensor_parallel_test: one
// table of named layouts, one way to run anvil (a single process or under
// mpirun) on a small text corpus, and one comparison of a layout's run with the
// single process's.
//
// Every parity case trains 10 fp32 steps from the same initial weights on the
// same global batches, once under the layout (2 sequences of 32 tokens per
// micro-batch per data-parallel rank) and once in a single process taking the
// whole global batch in one micro-batch per accumulation step, and asks for
// losses and gradient norms within 1e-5 relative at every step and final
// weights within 1e-5 relative norm. The layouts differ from one process only
// in the order of floating-point sums (gradients reduced over ranks, partial
// products reduced over tp, the log-sum-exp combined from shard maxima, losses
// summed in fp32), a few ulps per step, far inside 1e-5; a wrong shard or
// slice, a missed reduction or a token seen twice moves the loss by orders of
// magnitude more.
//
// Each run is also held against the memory estimate (train/estimate.h)
// of its flags (expect_estimate_matches_allocator): on every rank, step 2's
// allocations and frees equal its dry run's event for event, and the run's
// peaks — every category, the total, the reserved bytes — equal the dry run's
// to the byte; besides, the layout's estimate of parameters, gradients,
// optimizer state and activations within 1% of the per-step peaks the metrics
// log, and its peak total within 3%.
//
// A new layout (pp2_1f1b) is one row of layouts(): its cases then run in
// distributed_test, or in tensor_parallel_test when it has a tp degree.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <ostream>
#include <sstream>
#include <array>
#include <string>
#include <vector>

#include "anvil/model/args.h"
#include "anvil/train/config.h"
#include "anvil/train/estimate.h"
#include "allocation_timeline.h"
#include "mpi_test_util.h"
#include "run_cache.h"
#include "test_util.h"

namespace anvil::testing {

// How one parity case of a layout differs from its plain run.
struct Variant {
  std::string label;            // printed after the layout's name; "" for the plain run
  std::vector<std::string> ac;  // activation-checkpointing modes it runs under: none, full, op (selective op)
  int accumulation = 1;         // micro-batches per rank per step
  std::string flags = "";       // more flags for the layout's run only
  std::string model = "";       // flags for both runs (a model flavour)
  // The layout's memory depends on the data (a mixture of experts' learned
  // routing under expert parallelism: the tokens a rank's experts receive),
  // so its dry run at the balanced load is not held against it to the byte:
  // re-estimated at the busiest rank's measured load, it bounds every rank's
  // peak; the single process's still equals its dry run's.
  bool data_dependent_memory = false;
  double bound = 0;  // the case's bound when tighter than its layout's; 0: the layout's
};

struct Layout {
  std::string name;  // the table's key: also the printed name and part of the run folders
  int ranks;
  int dp;            // data-parallel degree: the single process takes dp ranks' batches at once
  int tp;            // tensor-parallel degree: tensor_parallel_test runs the cases of tp > 1
  std::string flags;  // [parallelism] flags
  std::vector<Variant> parity;  // the cases compared with the single process
  int pp = 1;        // pipeline stages: pipeline_test runs the cases of pp > 1
  int local = 2;     // sequences per rank per micro-batch (a pipeline cuts them into micro-batches of 1)
  // The relative bound on losses, gradient norms and final weights (see above;
  // pipelines: below).
  double bound = 1e-5;
  int cp = 1;  // context-parallel degree: context_parallel_test runs the cases of cp > 1
};

inline const std::vector<std::string> kEveryAc = {"none", "full", "op"};
inline const std::string kPipeline =
    "--parallelism.pipeline_parallel_microbatch_size 1 --parallelism.pipeline_parallel_degree ";
inline const std::string kContext = "--parallelism.context_parallel_degree ";
inline const std::string kMoe = "--model.name qwen3 --model.flavor debugmodel_moe --model.router_aux_loss_coef 0.01";
inline const std::string kAllgather = "--parallelism.context_parallel_rotate_method allgather";
// Muon with Newton-Schulz in f32, so that a layout's differences from the single
// process are its sums' order alone. Bound 1e-6: Newton-Schulz normalises its
// input and moves each matrix by lr' times an orthogonal update, so a few ulps
// in the summed gradients (6e-8 each) stay a few ulps in the update; a matrix
// orthogonalised from a wrong run, or a run sent back to the wrong rank, moves
// the loss by 1e-3 or more.
inline const std::string kMuon = "--optimizer.name Muon --optimizer.muon_ns_dtype float32";
inline constexpr double kMuonBound = 1e-6;

inline const std::vector<Layout>& layouts() {
  static const std::vector<Layout> table = {
      {"single", 1, 1, 1, "", {}},
      {"ddp2",
       2,
       2,
       1,
       "--parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 1",
       {{"", kEveryAc},
        {"qwen3/debugmodel_moe", {"none"}, 1, "", kMoe},
        // Expert parallelism: each rank holds 4 of the 8 experts and exchanges routed rows; under
        // forced-balanced routing its memory is the dry run's to the byte, under learned routing
        // it follows the tokens its experts receive.
        {"qwen3/debugmodel_moe, expert parallel 2, balanced routing", kEveryAc, 1,
         "--parallelism.expert_parallel_degree 2", kMoe + " --model.moe_routing balanced"},
        // 33 tokens × top-2 over 8 experts leaves a remainder per sequence: the first two
        // experts get one more row from every sequence, so rank 0 receives more than it sends.
        {"qwen3/debugmodel_moe, expert parallel 2, balanced routing, seq 33", {"none"}, 1,
         "--parallelism.expert_parallel_degree 2", kMoe + " --model.moe_routing balanced --training.seq_len 33"},
        {"qwen3/debugmodel_moe, expert parallel 2, accumulation 2",
         {"none", "op"},
         2,
         "--parallelism.expert_parallel_degree 2",
         kMoe,
         /*data_dependent_memory=*/true}}},
      {"fsdp2",
       2,
       2,
       1,
       "--parallelism.data_parallel_shard_degree -1",
       {{"", kEveryAc},
        {"accumulation 4", kEveryAc, 4},
        // A mixture of experts: its experts one (E, ., .) tensor of the gathered group, its
        // load-balancing loss a mean over every rank's sequences; the dry run's balanced
        // routing against a real run of it, then the learned routing.
        {"qwen3/debugmodel_moe, balanced routing",
         {"none", "full", "op"},
         1,
         "",
         kMoe + " --model.moe_routing balanced"},
        {"qwen3/debugmodel_moe, accumulation 2", {"none", "op"}, 2, "", kMoe},
        // Expert parallelism over FSDP: each rank holds 4 of the 8 experts whole (an expert shard
        // group of one), the rest of each block sharded over both ranks.
        {"qwen3/debugmodel_moe, expert parallel 2, balanced routing", kEveryAc, 1,
         "--parallelism.expert_parallel_degree 2", kMoe + " --model.moe_routing balanced"},
        {"qwen3/debugmodel_moe, expert parallel 2, accumulation 2",
         {"none", "op"},
         2,
         "--parallelism.expert_parallel_degree 2",
         kMoe,
         /*data_dependent_memory=*/true},
        // Muon: each rank owns every other matrix, gathers it from both ranks' runs and sends each its run back.
        {"Muon", {"none", "full"}, 1, "", kMuon, false, kMuonBound},
        {"Muon, accumulation 2", {"none"}, 2, "", kMuon, false, kMuonBound},
        {"qwen3/debugmodel_moe, Muon", {"none"}, 1, "", kMoe + " " + kMuon, false, kMuonBound},
        // DeepSeek-V3's router: every rank moves the expert biases by the step's routes over both.
        {"qwen3/debugmodel_moe, sigmoid scores and expert biases, expert parallel 2",
         {"none"},
         2,
         "--parallelism.expert_parallel_degree 2",
         kMoe + " --model.moe_score_function sigmoid --model.moe_bias_update_rate 0.01",
         /*data_dependent_memory=*/true}}},
      {"fsdp4",
       4,
       4,
       1,
       "--parallelism.data_parallel_shard_degree 4",
       {{"", kEveryAc},
        // Ranks 0-1 and 2-3 each split the experts; ranks 0 and 2 (1 and 3) shard the same 4 experts.
        {"qwen3/debugmodel_moe, expert parallel 2, balanced routing",
         {"none", "op"},
         1,
         "--parallelism.expert_parallel_degree 2",
         kMoe + " --model.moe_routing balanced"},
        {"qwen3/debugmodel_moe, expert parallel 2, balanced routing, seq 33",
         {"none"},
         1,
         "--parallelism.expert_parallel_degree 2",
         kMoe + " --model.moe_routing balanced --training.seq_len 33"},
        // Muon under EP 2 × FSDP 2: the dense matrices gathered over 4 ranks, each expert's over the 2 holding it.
        {"qwen3/debugmodel_moe, expert parallel 2, balanced routing, Muon",
         {"none"},
         1,
         "--parallelism.expert_parallel_degree 2",
         kMoe + " --model.moe_routing balanced " + kMuon,
         false,
         kMuonBound}}},
      {"hsdp2x2",
       4,
       4,
       1,
       "--parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 2",
       {{"", kEveryAc},
        // Each replica gathers and orthogonalises its own matrices over its 2 shard ranks.
        {"Muon", {"none"}, 1, "", kMuon, false, kMuonBound},
        // Each replica splits the experts over its 2 shard ranks; the replicas all-reduce them.
        {"qwen3/debugmodel_moe, expert parallel 2, balanced routing",
         {"none"},
         1,
         "--parallelism.expert_parallel_degree 2",
         kMoe + " --model.moe_routing balanced"}}},
      {"tp2",
       2,
       1,
       2,
       "--parallelism.tensor_parallel_degree 2",
       {{"", kEveryAc},
        {"sequence parallel off", {"none", "op"}, 1, "--parallelism.enable_sequence_parallel false"},
        {"loss parallel off", {"none"}, 1, "--parallelism.disable_loss_parallel true"},
        // 8 query heads over 4 KV heads: each rank runs 4 query heads over 2 KV heads.
        {"llama3/25M (GQA)", {"none"}, 1, "", "--model.flavor 25M"},
        // Qwen3's q/k norms: each rank's heads add to their gradients, summed over the ranks.
        {"qwen3/debugmodel", {"none", "op"}, 1, "", "--model.name qwen3"},
        {"qwen3/debugmodel, sequence parallel off",
         {"none"},
         1,
         "--parallelism.enable_sequence_parallel false",
         "--model.name qwen3"},
        // A mixture of experts: each rank holds every expert's half width and routes every row
        // whole; its partial output is reduced as a row-parallel product's.
        {"qwen3/debugmodel_moe, balanced routing", kEveryAc, 1, "", kMoe + " --model.moe_routing balanced"},
        {"qwen3/debugmodel_moe, accumulation 2", {"op"}, 2, "", kMoe},
        {"qwen3/debugmodel_moe, sequence parallel off",
         {"none"},
         1,
         "--parallelism.enable_sequence_parallel false",
         kMoe},
        // Muon: each rank owns every other matrix, gathers both ranks' slices of it and sends each its slice back.
        {"Muon", {"none"}, 1, "", kMuon, false, kMuonBound},
        {"qwen3/debugmodel_moe, Muon", {"none"}, 1, "", kMoe + " " + kMuon, false, kMuonBound}}},
      {"tp4", 4, 1, 4, "--parallelism.tensor_parallel_degree 4", {{"", kEveryAc}}},
      // With accumulation the sequence-parallel norm gradients of the second
      // micro-batch must not re-sum the first's.
      {"fsdp2_tp2",
       4,
       2,
       2,
       "--parallelism.tensor_parallel_degree 2 --parallelism.data_parallel_shard_degree 2",
       {{"", kEveryAc},
        {"accumulation 2", {"none"}, 2},
        {"qwen3/debugmodel, accumulation 2", {"none"}, 2, "", "--model.name qwen3"},
        {"qwen3/debugmodel_moe, accumulation 2", {"none"}, 2, "", kMoe},
        // Muon: a matrix's tp slice gathered from its FSDP runs, then the slices over the tp group, to one owner.
        {"Muon", {"none"}, 1, "", kMuon, false, kMuonBound}}},
      // DDP composes with TP as FSDP does (its buckets hold each tp rank's slices).
      {"ddp2_tp2",
       4,
       2,
       2,
       "--parallelism.tensor_parallel_degree 2 --parallelism.data_parallel_shard_degree 1 "
       "--parallelism.data_parallel_replicate_degree 2",
       {{"", {"none"}},
        // Expert parallelism over the DDP ranks, each tp rank holding half of every local expert's width.
        {"qwen3/debugmodel_moe, expert parallel 2, balanced routing",
         {"none", "op"},
         1,
         "--parallelism.expert_parallel_degree 2",
         kMoe + " --model.moe_routing balanced"},
        {"qwen3/debugmodel_moe, expert parallel 2, accumulation 2",
         {"none"},
         2,
         "--parallelism.expert_parallel_degree 2",
         kMoe,
         /*data_dependent_memory=*/true}}},
      // Pipelines: each rank's 2 (or 4) sequences run as micro-batches of 1,
      // every schedule at PP 2 and PP 4 (the looped and V schedules with 2
      // stages per rank: 4 or 8 stages of debugmodel's 8 units). Bound 1e-6:
      // a pipeline sums the same products as the single process, only the
      // micro-batches' partial sums of gradients and losses in another order
      // (fp32, 6e-8 per rounding, a few roundings deep over 10 steps: the
      // measured worst is about 1e-7); a boundary tensor sent to the wrong
      // stage or micro-batch, or a W pass missed, moves the loss by 1e-3 or more.
      {"pp2_1f1b",
       2,
       1,
       1,
       kPipeline + "2 --parallelism.pipeline_parallel_schedule 1F1B",
       {{"", kEveryAc},
        {"accumulation 2", {"none"}, 2},
        // Stage 0: the embedding and 4 blocks; stage 1: 2 blocks and the head.
        {"head counted as 3 blocks", {"none"}, 1, "--parallelism.pipeline_parallel_last_stage_less_layers 3"},
        {"automatic split", {"none"}, 1, "--parallelism.pipeline_parallel_auto_split true"},
        // A mixture of experts in stages: each stage's layers add their routes and aux losses, and
        // every stage scales its routers' gradients by the whole model's layer count.
        {"qwen3/debugmodel_moe, balanced routing", kEveryAc, 1, "", kMoe + " --model.moe_routing balanced"},
        {"qwen3/debugmodel_moe, accumulation 2", {"none"}, 2, "", kMoe},
        // Muon: each stage orthogonalises its own matrices, held whole.
        {"Muon", {"none"}, 1, "", kMuon},
        {"qwen3/debugmodel_moe, Muon", {"none"}, 1, "", kMoe + " " + kMuon}},
       2,
       2,
       1e-6},
      {"pp2_gpipe",
       2,
       1,
       1,
       kPipeline + "2 --parallelism.pipeline_parallel_schedule GPipe",
       {{"", {"none", "full"}}},
       2,
       2,
       1e-6},
      {"pp2_interleaved",
       2,
       1,
       1,
       kPipeline + "2 --parallelism.pipeline_parallel_schedule Interleaved1F1B",
       {{"", kEveryAc}, {"accumulation 2", {"none"}, 2}},
       2,
       2,
       1e-6},
      {"pp2_looped_bfs",
       2,
       1,
       1,
       kPipeline + "2 --parallelism.pipeline_parallel_schedule LoopedBFS",
       {{"", {"none"}}},
       2,
       2,
       1e-6},
      {"pp2_zero_bubble",
       2,
       1,
       1,
       kPipeline + "2 --parallelism.pipeline_parallel_schedule InterleavedZeroBubble",
       {{"", kEveryAc}},
       2,
       2,
       1e-6},
      {"pp2_zbv",
       2,
       1,
       1,
       kPipeline + "2 --parallelism.pipeline_parallel_schedule ZBVZeroBubble",
       {{"", kEveryAc},
        {"accumulation 2", {"none"}, 2},
        // The split backward: a MoE layer makes its weight gradients in the input-gradient pass.
        {"qwen3/debugmodel_moe", {"none", "op"}, 1, "", kMoe}},
       2,
       2,
       1e-6},
      // A CSV schedule: one stage per rank, 1F1B with the backward split into
      // I and W (tests/data/pipeline_pp2_zb.csv).
      {"pp2_csv",
       2,
       1,
       1,
       kPipeline + "2 --parallelism.pipeline_parallel_schedule_csv " ANVIL_SOURCE_DIR "/tests/data/pipeline_pp2_zb.csv",
       {{"", {"none"}}},
       2,
       2,
       1e-6},
      {"pp4_1f1b",
       4,
       1,
       1,
       kPipeline + "4 --parallelism.pipeline_parallel_schedule 1F1B",
       {{"", {"none"}}},
       4,
       4,
       1e-6},
      {"pp4_gpipe",
       4,
       1,
       1,
       kPipeline + "4 --parallelism.pipeline_parallel_schedule GPipe",
       {{"", {"none"}}},
       4,
       4,
       1e-6},
      {"pp4_interleaved",
       4,
       1,
       1,
       kPipeline + "4 --parallelism.pipeline_parallel_schedule Interleaved1F1B",
       {{"", {"none"}}},
       4,
       4,
       1e-6},
      {"pp4_looped_bfs",
       4,
       1,
       1,
       kPipeline + "4 --parallelism.pipeline_parallel_schedule LoopedBFS",
       {{"", {"none"}}},
       4,
       4,
       1e-6},
      {"pp4_zero_bubble",
       4,
       1,
       1,
       kPipeline + "4 --parallelism.pipeline_parallel_schedule InterleavedZeroBubble",
       {{"", {"none"}}},
       4,
       4,
       1e-6},
      {"pp4_zbv",
       4,
       1,
       1,
       kPipeline + "4 --parallelism.pipeline_parallel_schedule ZBVZeroBubble",
       {{"", {"none"}}},
       4,
       4,
       1e-6},
      // With data parallelism: FSDP under the zero-bubble schedule reduces a
      // group's gradients only after every W pass that adds to them.
      {"pp2_fsdp2",
       4,
       2,
       1,
       kPipeline + "2 --parallelism.data_parallel_shard_degree 2",
       {{"", {"none"}},
        {"InterleavedZeroBubble", {"none"}, 1, "--parallelism.pipeline_parallel_schedule InterleavedZeroBubble"},
        // Each stage's 2 FSDP ranks split its layers' experts.
        {"qwen3/debugmodel_moe, expert parallel 2, balanced routing",
         {"none"},
         1,
         "--parallelism.expert_parallel_degree 2",
         kMoe + " --model.moe_routing balanced"}},
       2,
       2,
       1e-6},
      {"pp2_ddp2",
       4,
       2,
       1,
       kPipeline + "2 --parallelism.data_parallel_shard_degree 1 --parallelism.data_parallel_replicate_degree 2",
       {{"", {"none"}},
        {"accumulation 2", {"none"}, 2},
        {"ZBVZeroBubble, accumulation 2", {"none"}, 2, "--parallelism.pipeline_parallel_schedule ZBVZeroBubble"},
        // Each stage's 2 DDP ranks split its layers' experts; learned routing over 2 micro-batches.
        {"qwen3/debugmodel_moe, expert parallel 2, accumulation 2",
         {"none"},
         2,
         "--parallelism.expert_parallel_degree 2",
         kMoe,
         /*data_dependent_memory=*/true}},
       2,
       2,
       1e-6},
      {"pp2_tp2",
       4,
       1,
       2,
       kPipeline + "2 --parallelism.tensor_parallel_degree 2",
       {{"", {"none"}}, {"Interleaved1F1B", {"none"}, 1, "--parallelism.pipeline_parallel_schedule Interleaved1F1B"}},
       2,
       2,
       1e-6},
      // HSDP under PP: each stage's shards reduced over 2 shards, then over 2 replicas (8 ranks).
      {"pp2_hsdp2x2",
       8,
       4,
       1,
       kPipeline + "2 --parallelism.data_parallel_replicate_degree 2 --parallelism.data_parallel_shard_degree 2",
       {{"", {"none"}}},
       2,
       2,
       1e-6},
      // Context parallelism: every sequence of 32 tokens in 2·cp chunks, two per
      // rank (head-tail unless said). Bound 1e-6: the chunks' attention sums the
      // same products as the whole sequence's, the keys' gradients are summed
      // over the ranks and the weights' over the FSDP shards (dp_shard × cp) in
      // another order, a few roundings of 6e-8; a chunk at the wrong position
      // (RoPE, the causal mask) or a gradient sent to the wrong rank moves the
      // loss by 1e-3 or more.
      {"cp2",
       2,
       1,
       1,
       kContext + "2",
       {{"", kEveryAc},
        {"accumulation 2", {"none"}, 2},
        {"contiguous chunks", {"none"}, 1, "--parallelism.context_parallel_load_balancer none"},
        {"llama3/25M (GQA)", {"none"}, 1, "", "--model.flavor 25M"},
        {"qwen3/debugmodel", {"none"}, 1, "", "--model.name qwen3"},
        // A mixture of experts: each sequence's load-balancing sums over its chunks on both ranks.
        {"qwen3/debugmodel_moe", kEveryAc, 1, "", kMoe},
        {"qwen3/debugmodel_moe, accumulation 2", {"none"}, 2, "", kMoe},
        {"qwen3/debugmodel_moe, balanced routing", {"none"}, 1, "", kMoe + " --model.moe_routing balanced"},
        {"qwen3/debugmodel_moe, allgather", {"none"}, 1, kAllgather, kMoe},
        // The all-gather: every rank gathers the whole sequences' keys and values.
        {"allgather", kEveryAc, 1, kAllgather},
        {"allgather, accumulation 2", {"none"}, 2, kAllgather},
        {"allgather, contiguous chunks",
         {"none"},
         1,
         kAllgather + " --parallelism.context_parallel_load_balancer none"},
        {"allgather, llama3/25M (GQA)", {"none"}, 1, kAllgather, "--model.flavor 25M"},
        // Muon: FSDP's shards span dp_shard × cp, so the cp ranks trade each matrix's runs.
        {"Muon", {"none"}, 1, "", kMuon}},
       1,
       2,
       1e-6,
       2},
      {"cp4",
       4,
       1,
       1,
       kContext + "4",
       {{"", {"none", "full"}},
        {"contiguous chunks", {"none"}, 1, "--parallelism.context_parallel_load_balancer none"},
        {"qwen3/debugmodel_moe", {"none"}, 1, "", kMoe},
        {"allgather", {"none", "full"}, 1, kAllgather},
        {"allgather, contiguous chunks",
         {"none"},
         1,
         kAllgather + " --parallelism.context_parallel_load_balancer none"}},
       1,
       2,
       1e-6,
       4},
      {"cp2_fsdp2",
       4,
       2,
       1,
       kContext + "2 --parallelism.data_parallel_shard_degree 2",
       {{"", {"none"}}, {"allgather", {"none"}, 1, kAllgather}, {"qwen3/debugmodel_moe", {"none"}, 1, "", kMoe}},
       1,
       2,
       1e-6,
       2},
      {"cp2_tp2",
       4,
       1,
       2,
       kContext + "2 --parallelism.tensor_parallel_degree 2",
       {{"", {"none", "op"}}, {"allgather", {"none"}, 1, kAllgather}, {"qwen3/debugmodel_moe", {"none"}, 1, "", kMoe}},
       1,
       2,
       1e-6,
       2},
      // Under a pipeline: each stage's cp ranks pass their chunks of a
      // micro-batch's boundary tensors to the same cp rank of the next stage.
      {"cp2_pp2",
       4,
       1,
       1,
       kPipeline + "2 --parallelism.pipeline_parallel_schedule 1F1B " + kContext + "2",
       {{"", {"none", "full"}},
        {"ZBVZeroBubble", {"none"}, 1, "--parallelism.pipeline_parallel_schedule ZBVZeroBubble"},
        {"InterleavedZeroBubble, allgather",
         {"none"},
         1,
         "--parallelism.pipeline_parallel_schedule InterleavedZeroBubble " + kAllgather},
        {"accumulation 2", {"none"}, 2},
        {"qwen3/debugmodel_moe", {"none"}, 1, "", kMoe}},
       2,
       2,
       1e-6,
       2},
      {"cp2_fsdp2_tp2",
       8,
       2,
       2,
       kContext + "2 --parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 2",
       {{"", {"none"}}, {"allgather", {"none"}, 1, kAllgather}},
       1,
       2,
       1e-6,
       2},
      // 3-D: 8 ranks on this 2-core machine (oversubscribed; tiny model).
      {"pp2_fsdp2_tp2",
       8,
       2,
       2,
       kPipeline + "2 --parallelism.data_parallel_shard_degree 2 --parallelism.tensor_parallel_degree 2",
       {{"", {"none", "op"}}, {"accumulation 2", {"full"}, 2}},
       2,
       2,
       1e-6},
  };
  return table;
}

inline const Layout& layout(const std::string& name) {
  for (const Layout& l : layouts())
    if (l.name == name) return l;
  ADD_FAILURE() << "no layout '" << name << "' in layouts() (tests/layout_parity.h)";
  return layouts().front();
}

inline std::string ac_flags(const std::string& ac) {
  return ac == "op" ? "--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op"
                    : "--activation_checkpoint.mode " + ac;
}

inline std::string batch_flags(int local, int global) {
  return "--training.local_batch_size " + std::to_string(local) + " --training.global_batch_size " +
         std::to_string(global);
}

// A folder or test name: letters and digits, each run of anything else one '_'
// (labels hold spaces, ',', '/' and '(').
inline std::string tag_of(const std::string& s) {
  std::string out;
  for (const char c : s) {
    if (std::isalnum(static_cast<unsigned char>(c)))
      out += c;
    else if (!out.empty() && out.back() != '_')
      out += '_';
  }
  if (!out.empty() && out.back() == '_') out.pop_back();
  return out;
}

// anvil train runs in this test program's scratch folder, each in its own dump
// folder, on a small corpus of documents (JSON Lines, 3 to 63 bytes each, so
// a 32-token sequence holds documents shorter than it, cut by it and longer
// than it, many spanning context-parallel chunks) under the default
// block-causal attention: 10 fp32 steps (flags given later win), a metrics
// line per step, checkpoints at steps 5 and 10, both kept, and every rank's
// allocations and frees of step 2 logged. text.txt, one long document, is
// there for tests that need plain text.
class TrainRuns {
 public:
  TrainRuns() : dir_(scratch_root() / "runs") {
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
    std::ofstream text(dir_ / "text.txt");
    for (int i = 0; i < 600; ++i)
      text << "Line " << i % 29 << ": the jury's presentments praised the city's purchasing department, "
           << i * 7 % 13 << " times.\n";
    std::ofstream docs(dir_ / "documents.jsonl");
    const std::string words = "the jury praised the city's purchasing department and its many presentments ";
    for (int i = 0; i < 1500; ++i) {
      const size_t n = 3 + static_cast<size_t>(i * 37 % 61);
      std::string doc = std::to_string(i % 29) + " ";
      for (size_t k = 0; doc.size() < n; ++k) doc += words[(static_cast<size_t>(i) * 5 + k) % words.size()];
      docs << "{\"text\": \"" << doc.substr(0, n) << "\"}\n";
    }
  }

  const std::filesystem::path& dir() const { return dir_; }

  std::string args(const std::string& dump, const std::string& extra) const {
    return "train --training.dataset text --training.dataset_path " + (dir_ / "documents.jsonl").string() +
           " --training.seq_len 32 --training.steps 10 --metrics.log_freq 1 --training.mixed_precision_param float32"
           " --lr_scheduler.warmup_steps 2 --checkpoint.enable --checkpoint.interval 5 --checkpoint.keep_latest_k 0"
           " --metrics.enable_tensorboard false --profiling.allocation_log_step 2 --job.dump_folder " +
           (dir_ / dump).string() + " " + extra;
  }

  CommandOutput single(const std::string& dump, const std::string& extra) const {
    return run_anvil(args(dump, extra), "OMP_NUM_THREADS=2 ");
  }

  // `env`: variables for mpirun and the ranks ("ANVIL_FAULT_KILL_RANK=1:3 ").
  CommandOutput mpi(int ranks, const std::string& dump, const std::string& extra, const std::string& env = "") const {
    return run_anvil(args(dump, extra), env + mpirun_prefix(ranks));
  }

  // Under `layout`: in one process for "single", else under mpirun with its flags.
  CommandOutput run(const Layout& layout, const std::string& dump, const std::string& extra) const {
    return layout.ranks == 1 ? single(dump, extra + " " + layout.flags)
                             : mpi(layout.ranks, dump, extra + " " + layout.flags);
  }

  // A run's `key` ("loss", "grad_norm") by step.
  std::map<int64_t, double> metric(const std::string& dump, const char* key) const {
    return metric_by_step(dir_ / dump / "metrics.jsonl", key);
  }
  std::map<int64_t, double> losses(const std::string& dump) const { return metric(dump, "loss"); }
  // A mixture of experts' routes per layer and expert, by step (empty for a dense model).
  std::map<int64_t, std::vector<std::vector<double>>> routes_by_layer(const std::string& dump) const {
    std::map<int64_t, std::vector<std::vector<double>>> out;
    std::ifstream in(dir_ / dump / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      const nlohmann::json j = nlohmann::json::parse(line);
      if (j.contains("loss") && j.contains("moe_routes_by_layer"))
        out[j["step"].get<int64_t>()] = j["moe_routes_by_layer"].get<std::vector<std::vector<double>>>();
    }
    return out;
  }

  // ||a − b|| / ||b|| over every tensor of the two runs' checkpoints of `step` (`file`: model or optimizer).
  double checkpoint_difference(const std::string& a, const std::string& b, int step = 10,
                               const std::string& file = "model.safetensors") const {
    const std::string at = "step-" + std::to_string(step);
    return safetensors_relative_difference(dir_ / a / "checkpoint" / at / file, dir_ / b / "checkpoint" / at / file);
  }

  // The dump folder of a single-process run with `flags`, run once per set of
  // flags and shared by every case and test that needs it: of this program
  // by the map, of the other programs and cases by the cache on disk
  // (tests/run_cache.h), keyed by the run's arguments and the corpus.
  std::string reference(const std::string& flags) {
    const auto it = references_.find(flags);
    if (it != references_.end()) return it->second;
    const std::string dump = "single_" + std::to_string(references_.size());
    references_[flags] = dump;
    std::string key = args("<dump>", flags);
    for (size_t at; (at = key.find(dir_.string())) != std::string::npos;) key.replace(at, dir_.string().size(), "<runs>");
    for (const char* file : {"documents.jsonl", "text.txt"}) {
      std::ifstream in(dir_ / file);
      std::stringstream text;
      text << in.rdbuf();
      key += "\n" + std::string(file) + ":\n" + text.str();
    }
    const RunCache cache;
    if (const std::filesystem::path entry = cache.find(key); !entry.empty()) {
      std::filesystem::create_directory_symlink(entry, dir_ / dump);
      return dump;
    }
    const CommandOutput ref = single(dump, flags);
    EXPECT_EQ(ref.exit_code, 0) << ref.text;
    if (ref.exit_code == 0) cache.keep(dir_ / dump, key);
    return dump;
  }

 private:
  std::filesystem::path dir_;
  std::map<std::string, std::string> references_;
};

inline TrainRuns& runs() {
  static TrainRuns r;
  return r;
}

// The estimate of a run held against what the tracking allocator measured on
// each of its ranks (the largest of every logged step's peaks, which cover
// two checkpoint saves): parameters, gradients, optimizer state and
// activations within 1%, the peak total within 3%. The estimate is computed
// here, in-process, from the run's own flags (`train_args`, as given to anvil
// train), for its world size. Returns the worst relative error of the four
// categories and of the total.
struct EstimateCheck {
  double categories = 0, total = 0;
  size_t events = 0;  // allocations and frees of step 2 found equal in the dry run, over the ranks
};
// `exact`: each category and the total must equal the allocator's to the
// byte (forced-balanced routing under expert parallelism, whose dry run
// reproduces the router's counts); else within 1% and 3%.
inline EstimateCheck expect_estimate_matches_allocator(const std::filesystem::path& dump, const std::string& train_args,
                                                       int ranks, bool exact = false) {
  std::vector<std::string> words;
  std::istringstream in(train_args);
  for (std::string w; in >> w;)
    if (w != "train") words.push_back(w);
  const JobConfig cfg = parse_config(words);
  const ModelArgs args = job_model_args(cfg);
  const LayoutEstimate est = estimate_layout(cfg, args, ranks);
  // Step 2 of every rank, event by event, against its dry run.
  // (TrainRuns runs a single process on 2 threads, mpirun's ranks on 1 each.)
  const size_t events = expect_dry_run_matches_log(dump, cfg, ranks, ranks == 1 ? 2 : 1);
  // Measured: per rank, the largest of each category's peak and of the total over the logged steps.
  std::vector<std::array<double, kNumMemCategories>> measured(static_cast<size_t>(ranks));
  std::vector<double> total(static_cast<size_t>(ranks), 0);
  std::ifstream metrics(dump / "metrics.jsonl");
  int steps = 0;
  for (std::string line; std::getline(metrics, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (!j.contains("loss")) continue;
    ++steps;
    for (int r = 0; r < ranks; ++r) {
      const nlohmann::json& cats =
          ranks == 1 ? j["max_active_bytes_by_category"] : j["max_active_bytes_by_rank_by_category"][r];
      for (int c = 0; c < kNumMemCategories; ++c) {
        double& m = measured[static_cast<size_t>(r)][static_cast<size_t>(c)];
        m = std::max(m, cats[category_name(static_cast<MemCategory>(c))].get<double>());
      }
      const double t = ranks == 1 ? j["max_active_bytes"].get<double>()
                                  : j["peak_mib_by_rank"][r].get<double>() * (1 << 20);
      total[static_cast<size_t>(r)] = std::max(total[static_cast<size_t>(r)], t);
    }
  }
  EXPECT_GT(steps, 0) << "no step lines in " << (dump / "metrics.jsonl");
  // The tensor-, pipeline- and expert-parallel bytes rank 0 sent (and, pp,
  // received) in step 2, which saves no checkpoint: the replay's count of
  // every collective.
  if (ranks > 1) {
    std::ifstream again(dump / "metrics.jsonl");
    for (std::string line; std::getline(again, line);) {
      const nlohmann::json j = nlohmann::json::parse(line);
      if (!j.contains("loss") || j["step"].get<int>() != 2) continue;
      const RankEstimate& r0 = est.ranks[0];
      EXPECT_EQ(j["tp_comm_bytes_per_step"].get<double>(), r0.tensor_parallel_bytes) << "tensor-parallel bytes";
      EXPECT_EQ(j["pp_comm_bytes_per_step"].get<double>(), r0.pipeline_bytes) << "pipeline bytes";
      EXPECT_EQ(j["ep_comm_bytes_per_step"].get<double>(), r0.expert_parallel_bytes) << "expert-parallel bytes";
    }
  }
  EstimateCheck worst;
  worst.events = events;
  for (int r = 0; r < ranks && steps > 0; ++r) {
    const RankEstimate& e = est.ranks[static_cast<size_t>(r)];
    for (MemCategory c : {MemCategory::parameters, MemCategory::gradients, MemCategory::optimizer_state,
                          MemCategory::activations}) {
      const double m = measured[static_cast<size_t>(r)][static_cast<size_t>(c)];
      const double p = static_cast<double>(e.memory.bytes(c));
      const double err = m > 0 ? std::abs(p - m) / m : (p > 0 ? 1 : 0);
      worst.categories = std::max(worst.categories, err);
      EXPECT_LE(err, exact ? 0.0 : 0.01) << "rank " << r << " (pp rank " << e.pp_rank << ") " << category_name(c)
                                          << ": estimate " << p << " bytes, measured " << m;
    }
    const double m = total[static_cast<size_t>(r)], p = static_cast<double>(e.memory.peak_total);
    const double err = std::abs(p - m) / m;
    worst.total = std::max(worst.total, err);
    EXPECT_LE(err, exact ? 0.0 : 0.03) << "rank " << r << " (pp rank " << e.pp_rank << ") peak total: estimate " << p
                                       << " bytes, measured " << m;
  }
  return worst;
}

// A layout whose memory follows its learned routing (expert parallelism):
// the busiest rank's share of received rows (moe_received_share_by_rank,
// the most over the steps) re-estimated as model.moe_estimate_load, which
// gives every layer on every rank that load: each rank's measured peak must
// be at most that estimate's. Returns the load.
inline double expect_estimate_at_the_busiest_load_bounds_allocator(const std::filesystem::path& dump,
                                                                   const std::string& train_args, int ranks) {
  double load = 0;
  std::vector<double> peak(static_cast<size_t>(ranks), 0), activations(static_cast<size_t>(ranks), 0);
  std::ifstream metrics(dump / "metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (!j.contains("loss")) continue;
    EXPECT_TRUE(j.contains("moe_received_share_by_rank")) << "step " << j["step"] << " of " << dump;
    if (!j.contains("moe_received_share_by_rank")) continue;
    for (const double share : j["moe_received_share_by_rank"].get<std::vector<double>>()) load = std::max(load, share);
    for (int r = 0; r < ranks; ++r) {
      peak[static_cast<size_t>(r)] =
          std::max(peak[static_cast<size_t>(r)], j["peak_mib_by_rank"][r].get<double>() * (1 << 20));
      activations[static_cast<size_t>(r)] =
          std::max(activations[static_cast<size_t>(r)],
                   j["max_active_bytes_by_rank_by_category"][r][category_name(MemCategory::activations)].get<double>());
    }
  }
  EXPECT_GT(load, 0.0) << "no received shares in " << dump;
  std::vector<std::string> words;
  std::istringstream in(train_args + " --model.moe_estimate_load " + std::to_string(load));
  for (std::string w; in >> w;)
    if (w != "train") words.push_back(w);
  const JobConfig cfg = parse_config(words);
  const LayoutEstimate est = estimate_layout(cfg, job_model_args(cfg), ranks);
  for (int r = 0; r < ranks; ++r) {
    const MemoryEstimate& m = est.ranks[static_cast<size_t>(r)].memory;
    const double p = static_cast<double>(m.peak_total), a = static_cast<double>(m.bytes(MemCategory::activations));
    std::printf("  rank %d: peak %.0f bytes (activations %.0f) against %.0f (%.0f) estimated at load %.3f\n", r,
                peak[static_cast<size_t>(r)], activations[static_cast<size_t>(r)], p, a, load);
    EXPECT_GT(peak[static_cast<size_t>(r)], 0.0) << "rank " << r;
    EXPECT_LE(peak[static_cast<size_t>(r)], p) << "rank " << r << ": peak " << peak[static_cast<size_t>(r)]
                                               << " bytes above the estimate at the busiest load " << load;
    EXPECT_LE(activations[static_cast<size_t>(r)], a)
        << "rank " << r << ": activations above the estimate at the busiest load " << load;
  }
  return load;
}

// One row of the table under one variant and one AC mode.
struct ParityCase {
  const Layout* layout;
  const Variant* variant;
  std::string ac;
  std::string name() const { return layout->name + (variant->label.empty() ? "" : ", " + variant->label); }
};

// Every case of the layouts `select` takes, in table order.
inline std::vector<ParityCase> parity_cases(const std::function<bool(const Layout&)>& select) {
  std::vector<ParityCase> out;
  for (const Layout& l : layouts())
    if (select(l))
      for (const Variant& v : l.parity)
        for (const std::string& ac : v.ac) out.push_back({&l, &v, ac});
  return out;
}

// GoogleTest prints a case by its name, not its bytes.
inline void PrintTo(const ParityCase& c, std::ostream* os) { *os << c.name() << ", AC " << c.ac; }

// GoogleTest's name for a case: "fsdp2_accumulation_4_ac_full".
inline std::string parity_case_name(const ::testing::TestParamInfo<ParityCase>& info) {
  return tag_of(info.param.name() + "_ac_" + info.param.ac);
}

inline void expect_matches_single_process(const ParityCase& c) {
  const Layout& layout = *c.layout;
  const Variant& v = *c.variant;
  const double bound = v.bound > 0 ? v.bound : layout.bound;
  SCOPED_TRACE(c.name() + ", activation checkpointing " + c.ac);
  TrainRuns& r = runs();
  const int local = layout.local;
  const std::string common =
      "--training.mixed_precision_param float32 " + ac_flags(c.ac) + (v.model.empty() ? "" : " " + v.model);
  const int global = local * layout.dp * v.accumulation;
  const std::string ref_flags = batch_flags(local * layout.dp, global) + " " + common;
  const std::string ref = r.reference(ref_flags);
  const std::string tag = tag_of(c.name() + "_" + c.ac);
  const std::string flags = batch_flags(local, global) + " " + layout.flags + " " + v.flags + " " + common;
  const CommandOutput out = r.mpi(layout.ranks, tag, flags);
  ASSERT_EQ(out.exit_code, 0) << out.text;
  const bool balanced_ep = v.model.find("--model.moe_routing balanced") != std::string::npos &&
                          v.flags.find("--parallelism.expert_parallel_degree") != std::string::npos;
  const EstimateCheck mem =
      v.data_dependent_memory
          ? EstimateCheck{}
          : expect_estimate_matches_allocator(r.dir() / tag, r.args(tag, flags), layout.ranks, balanced_ep);
  const EstimateCheck ref_mem = expect_estimate_matches_allocator(r.dir() / ref, r.args(ref, ref_flags), 1);
  const double busiest = v.data_dependent_memory ? expect_estimate_at_the_busiest_load_bounds_allocator(
                                                       r.dir() / tag, r.args(tag, flags), layout.ranks)
                                                 : 0;
  const auto want = r.losses(ref), got = r.losses(tag);
  ASSERT_EQ(want.size(), 10u);
  ASSERT_EQ(got.size(), 10u) << out.text;
  double worst = 0;
  for (const auto& [step, loss] : want) {
    const double rel = std::abs(got.at(step) - loss) / std::abs(loss);
    worst = std::max(worst, rel);
    EXPECT_LE(rel, bound) << "step " << step << ": " << got.at(step) << " vs " << loss;
  }
  // The gradient norm (clipping uses it) counts each global element once, whatever the layout.
  const auto norm_want = r.metric(ref, "grad_norm"), norm_got = r.metric(tag, "grad_norm");
  ASSERT_EQ(norm_got.size(), norm_want.size());
  double worst_norm = 0;
  for (const auto& [step, norm] : norm_want) {
    const double rel = std::abs(norm_got.at(step) - norm) / norm;
    worst_norm = std::max(worst_norm, rel);
    EXPECT_LE(rel, bound) << "step " << step << ": grad_norm " << norm_got.at(step) << " vs " << norm;
  }
  const double wdiff = r.checkpoint_difference(tag, ref);
  EXPECT_LE(wdiff, bound);
  // Muon's gathers and scatters: every step sends what the layout says it will (none when each rank holds its
  // matrices whole, as a pipeline's stages do).
  if (v.model.find(kMuon) != std::string::npos) {
    const auto sent = r.metric(tag, "optimizer_comm_bytes_per_step");
    const auto closed = r.metric(tag, "optimizer_comm_bytes_closed_form");
    EXPECT_EQ(sent.size(), 10u);
    for (const auto& [step, bytes] : sent) EXPECT_EQ(bytes, closed.at(step)) << "step " << step << ": Muon's traffic";
    if (!sent.empty()) std::printf("%s: Muon's all-to-alls sent %.0f bytes per step\n", c.name().c_str(), sent.begin()->second);
    // And the formula apart from the code's own count: P matrix elements evenly sharded over n ranks send
    // 8·P·(n − 1)/n² bytes a rank (docs/muon.md); debugmodel's blocks shard evenly over 2.
    if (layout.name == "fsdp2" && v.model == kMuon) {
      const ModelArgs a = model_flavor("llama3", "debugmodel");
      const double P = static_cast<double>(a.n_layers * (a.params_per_layer() - 2 * a.dim));
      for (const auto& [step, bytes] : sent) EXPECT_EQ(bytes, 8 * P * (2 - 1) / 4) << "step " << step;
    }
  }
  // A mixture of experts: every step's routes per layer and expert, summed over
  // the ranks and stages, are the single process's exactly (a token routed
  // elsewhere would also move the loss), and its load-balancing loss within the bound.
  const auto routes_want = r.routes_by_layer(ref), routes_got = r.routes_by_layer(tag);
  EXPECT_EQ(routes_got, routes_want);
  // Routes that stopped being written would compare equal on both sides: a
  // mixture of experts must have them, for each of the 10 steps.
  const bool moe = v.model.find("moe") != std::string::npos;
  EXPECT_EQ(routes_want.empty(), !moe) << "moe_routes_by_layer in the single process's metrics";
  if (moe) {
    EXPECT_EQ(routes_want.size(), 10u) << "steps with routes";
  }
  if (!routes_want.empty()) {
    const auto aux_want = r.metric(ref, "moe_aux_loss"), aux_got = r.metric(tag, "moe_aux_loss");
    for (const auto& [step, aux] : aux_want)
      EXPECT_LE(std::abs(aux_got.at(step) - aux), bound * aux) << "step " << step << ": aux loss";
  }
  if (v.data_dependent_memory)
    std::printf(
        "%-34s AC %-5s worst loss difference %.2e, grad norm %.2e, final weights %.2e (relative); the "
        "layout's memory follows its routing: every rank's peak under the estimate at the busiest rank's "
        "load %.3f; the single process's step 2 (%zu allocations and frees) and peaks equal its dry run's\n",
        c.name().c_str(), c.ac.c_str(), worst, worst_norm, wdiff, busiest, ref_mem.events);
  else
    std::printf("%-34s AC %-5s worst loss difference %.2e, grad norm %.2e, final weights %.2e (relative); memory "
                "estimate per rank: categories within %.2e, total %.2e (single process: %.2e, %.2e); step 2's %zu "
                "allocations and frees equal in the dry run\n",
                c.name().c_str(), c.ac.c_str(), worst, worst_norm, wdiff, mem.categories, mem.total,
                ref_mem.categories, ref_mem.total, mem.events + ref_mem.events);
}

// bf16: `layout` against the single process on 4 sequences per step (times
// `accumulation`), split over its data-parallel ranks, within `bound` relative
// per step over 10 steps (each caller derives its bound).
// `variant` (a label and flags, e.g. {"allgather", kAllgather}) runs the layout with those flags too.
inline void expect_bf16_within(const Layout& layout, int accumulation, double bound,
                               const std::pair<std::string, std::string>& variant = {}) {
  TrainRuns& r = runs();
  const std::string bf16 = "--training.mixed_precision_param bfloat16 " + variant.second + " ";
  const std::string name = "bf16_" + layout.name + (variant.first.empty() ? "" : "_" + variant.first) +
                           (accumulation > 1 ? "_accum" + std::to_string(accumulation) : "");
  SCOPED_TRACE(name);
  const int global = 4 * accumulation;
  const std::string ref = r.reference("--training.mixed_precision_param bfloat16 " + batch_flags(4, global));
  const auto want = r.losses(ref);
  ASSERT_EQ(want.size(), 10u);
  const std::string flags = bf16 + batch_flags(4 / layout.dp, global);
  const CommandOutput out = r.run(layout, name, flags);
  ASSERT_EQ(out.exit_code, 0) << out.text;
  const EstimateCheck mem =
      expect_estimate_matches_allocator(r.dir() / name, r.args(name, flags + " " + layout.flags), layout.ranks);
  const auto got = r.losses(name);
  ASSERT_EQ(got.size(), 10u);
  double worst = 0;
  for (const auto& [step, loss] : want) {
    const double rel = std::abs(got.at(step) - loss) / std::abs(loss);
    worst = std::max(worst, rel);
    EXPECT_LE(rel, bound) << "step " << step;
  }
  std::printf("%-17s bf16: worst loss difference %.2e (bound %.0e), final weights %.2e; memory estimate per rank: "
              "categories within %.2e, total %.2e; step 2's %zu allocations and frees equal in the dry run\n",
              name.c_str(), worst, bound, r.checkpoint_difference(name, ref), mem.categories, mem.total, mem.events);
}

// Each test program instantiates this for its rows of the table:
//   INSTANTIATE_TEST_SUITE_P(Tp, LayoutParity, ValuesIn(parity_cases(...)), parity_case_name);
class LayoutParity : public ::testing::TestWithParam<ParityCase> {};

}  // namespace anvil::testing
