// The trainer's view of the job's layout: the MPI world when the program was
// started by mpirun or srun, the device mesh, this rank's place in it, and the
// data-parallel strategy its degrees select (torchtitan's rules):
//   dp_shard > 1                      FSDP (ZeRO-3); with dp_replicate > 1, HSDP
//   dp_shard = 1, dp_replicate > 1    DDP
//   one rank                          a single process, no MPI involved
// and, independently, tensor parallelism over the tp group when tp > 1 (2-D:
// FSDP shards each tp rank's slices over dp_shard), pipeline parallelism
// over the pp group when pp > 1 (each pp rank holds one or more stages), and
// context parallelism over the cp group when cp > 1 (each rank holds two
// chunks of every sequence; FSDP then shards over dp_shard × cp, so cp > 1
// alone is FSDP too).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "anvil/distributed/comm.h"
#include "anvil/distributed/context_parallel.h"
#include "anvil/distributed/mesh.h"
#include "anvil/model/args.h"
#include "anvil/pipeline/executor.h"
#include "anvil/train/config.h"

namespace anvil {

// True when an MPI launcher (mpirun/mpiexec, srun) started this process.
bool launched_by_mpi_launcher();

enum class DataParallelMode { single, ddp, fsdp };

struct ParallelDims {
  DataParallelMode mode = DataParallelMode::single;
  std::unique_ptr<DeviceMesh> mesh;  // null for a single process, and when only resolved
  MeshLayout layout{1, 1, 1, 1, 1};  // the degrees, resolved against the world size
  int rank = 0, world_size = 1;
  int dp_rank = 0, dp_size = 1;
  int tp_rank = 0, tp_size = 1;  // ranks of a tp group read the same data
  int pp_rank = 0, pp_size = 1;  // a pp group's ranks read the same data
  int cp_rank = 0, cp_size = 1;  // a cp group's ranks read the same sequences, each keeping its chunks
  int ep_rank = 0, ep_size = 1;  // expert parallelism: ep consecutive data-parallel ranks split the experts
  CpLoadBalancer cp_balancer = CpLoadBalancer::headtail;
  CpRotateMethod cp_rotate = CpRotateMethod::ring;
  // Under pipeline parallelism: each micro-batch of local_batch_size sequences
  // runs through the pipeline as this many micro-batches of
  // pipeline_parallel_microbatch_size sequences.
  int64_t pp_micro_batches = 1;
  PipelineSplit pp_split;    // how the module list is cut into the pipeline's stages
  PipeSchedule pp_schedule;  // which pp rank holds each stage, and every pp rank's actions per pass
  // Micro-batches per optimizer step: training.global_batch_size over
  // local_batch_size × the data-parallel degree, resolved and checked once here.
  int64_t accum_steps = 1;
  std::string description = "single process";

  bool distributed() const { return world_size > 1; }
  bool rank0() const { return rank == 0; }
  // Sums `values` over the data-parallel ranks, and the context-parallel ones
  // (whose tokens count apart), a no-op for one process.
  void sum_over_dp(float* values, int n) const;
  // FSDP's shard group: dp_shard, or dp_shard × cp under context parallelism.
  Communicator& fsdp_shard_group() const;
  int fsdp_shard_degree() const { return layout.dp_shard() * layout.cp(); }
  // Over how many ranks FSDP shards a rank's experts (MoE under FSDP): dp_shard / ep.
  int expert_shard_degree() const { return layout.group_size(MeshGroup::expert_shard); }
  // The largest of every rank's `value` (collective over the world; small
  // integers such as a signal number).
  int max_over_world(int value) const;
  // Every rank's `value`, by world rank (collective; as f32, enough for rates and MiB).
  std::vector<double> gather_world(double value) const;
  // Every rank's `values` (each rank the same count), rank after rank.
  std::vector<double> gather_world(const std::vector<double>& values) const;
};

// Every check of a layout against the model and the batch, in the keys that
// set them (training.seq_len against the model's max_seq_len, tensor-parallel
// heads and widths, context parallelism's chunks, sequence parallelism's split of
// a micro-batch's tokens — a pipeline micro-batch's under pipeline
// parallelism —, the pipeline micro-batch size, tied embeddings). Setup,
// the estimator and the trainer all reach it through resolve_parallel.
void validate_layout(const JobConfig& cfg, const ModelArgs& args, const MeshLayout& layout);

// Resolves and checks the [parallelism] degrees against the world and the
// model, on every rank with the same message, and the batch against them
// (accum_steps); checks that every rank has the same configuration. Requires
// MPI to be running when launched by MPI.
ParallelDims setup_parallel(const JobConfig& cfg, const ModelArgs& args);

// The same resolution and checks for rank `rank` of `world_size` ranks,
// without MPI (no mesh, no communicators): what the estimator plans with.
ParallelDims resolve_parallel(const JobConfig& cfg, const ModelArgs& args, int world_size, int rank);

}  // namespace anvil
