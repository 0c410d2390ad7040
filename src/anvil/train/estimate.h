// The estimate of a run under any layout, per rank, before any rank exists:
// a dry run (core/dry_run.h) of the trainer's own code. The configuration is
// resolved as the trainer resolves it (resolve_parallel: the mesh, the
// pipeline's cut and schedule, the accumulation); then each distinct rank
// role — every pipeline rank, and world rank 0, which writes checkpoints —
// builds its ParallelizedModel (the model with its tensor-parallel slices,
// FSDP or DDP, the pipeline executor) over dry communicators and runs two
// training steps and a checkpoint save (and one step more beside a
// background save's copy, when training goes on after it) through the functions the trainer
// calls (train/train_step.h), one role after another in this process. The
// dry allocator's peaks per category are that rank's; tests hold them, and
// the whole allocation timeline of a step, equal to a real run's.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "anvil/core/allocator.h"
#include "anvil/core/device.h"
#include "anvil/estimate/memory.h"
#include "anvil/model/args.h"
#include "anvil/train/config.h"
#include "anvil/train/parallel_dims.h"

namespace anvil {

struct RankEstimate {
  int rank = 0;
  int pp_rank = 0;
  std::vector<int> stages = {};  // the pipeline stages it holds (0 without pipeline parallelism)
  // Peak bytes per category; peak_total is the peak of their sum, as the
  // allocator's (at most the sum of the category peaks); peak_reserved what
  // the allocator's block cache holds at its fullest.
  MemoryEstimate memory;
  // A GPU job's device memory (a dry run on a GPU device), from the pool of the
  // dry run's fake GPU: peak per category (requested bytes), peak_total the
  // allocated blocks' peak (torch.cuda.max_memory_allocated's measure, the
  // blocks rounded to 512 bytes) and peak_reserved the segments' (its
  // max_memory_reserved). `memory` is then the host's side of the job.
  Device device = Device::cpu();
  MemoryEstimate device_memory;
  // Bytes this rank sends per step: the data-parallel closed form
  // (distributed/comm_volume.h); tensor-parallel and pipeline as the dry
  // run's communicators counted them in its second step (comm.h's comm_bytes).
  double data_parallel_bytes = 0, pipeline_bytes = 0, tensor_parallel_bytes = 0;
  double expert_parallel_bytes = 0;  // the experts' all-to-alls, under the dry run's routing case
  // Muon: its gathers and scatters under FSDP, and the Newton-Schulz FLOPs of
  // the matrices this rank owns (train/optimizer.h); zero under AdamW.
  double optimizer_bytes = 0, optimizer_flops = 0;
};

struct LayoutEstimate {
  ParallelDims par;                     // the resolved layout (no mesh)
  std::vector<RankEstimate> ranks;  // every rank, by world rank
  double flops_per_token = 0;
};

// `world_size`: the ranks the run would have (data_parallel_shard_degree = -1
// takes what the other degrees leave of them). A GPU `device`: the dry run of
// the GPU path (one rank), its device's figures in RankEstimate::device_memory.
LayoutEstimate estimate_layout(const JobConfig& cfg, const ModelArgs& args, int world_size,
                               Device device = Device::cpu());

// The dry run of one rank (its pre-flight check needs no other), with its step-2 allocation timeline (from the
// step's start to the end of its optimizer step: every allocation and free
// in order, with tag, category and bytes) when `step2` is not null. With a
// GPU `device`, the dry run of the GPU path: the model, its state and every
// step's tensors under ScopedDevice(device), over the device pool of a fake
// GPU (train/gpu_job.h says what a GPU job may be), no GPU needed.
RankEstimate dry_run_rank(const JobConfig& cfg, const ModelArgs& args, int world_size, int rank,
                          std::vector<MemEvent>* step2 = nullptr, Device device = Device::cpu());

}  // namespace anvil
