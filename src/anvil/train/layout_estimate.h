// The estimate of a run under any layout, per rank, before any rank exists:
// the configuration is resolved as the trainer resolves it (resolve_parallel:
// the mesh, the pipeline's cut and schedule, the accumulation), and each
// rank's training is replayed without data by the memory simulator
// (plan/memory_sim.h) — its stages' modules, its tensor-parallel slices, its
// FSDP shards, gathers and reduce-scatters, its pipeline schedule's actions
// with their receives and sends — for two steps and a checkpoint save. The
// replay's per-category peaks are what the tracking allocator records on that
// rank; tests hold them together for every layout of the parity table.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "anvil/model/args.h"
#include "anvil/plan/memory.h"
#include "anvil/train/config.h"
#include "anvil/train/parallel.h"

namespace anvil {

struct RankEstimate {
  int rank = 0;
  int pp_rank = 0;
  std::vector<int> stages = {};  // the pipeline stages it holds (0 without pipeline parallelism)
  // Peak bytes per category; peak_total is the peak of their sum, as the
  // allocator's (at most the sum of the category peaks).
  MemoryEstimate memory;
  // Bytes this rank sends per step (comm.h's comm_bytes), by group.
  double data_parallel_bytes = 0, pipeline_bytes = 0, tensor_parallel_bytes = 0;
};

struct LayoutEstimate {
  Parallel par;                     // the resolved layout (no mesh)
  std::vector<RankEstimate> ranks;  // every rank, by world rank
  double flops_per_token = 0;
};

// `world_size`: the ranks the run would have (data_parallel_shard_degree = -1
// takes what the other degrees leave of them).
LayoutEstimate estimate_layout(const JobConfig& cfg, const ModelArgs& args, int world_size);

}  // namespace anvil
