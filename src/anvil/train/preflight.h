// The pre-flight check: every rank, before it allocates anything, holds its
// own estimate (train/estimate.h) against the memory it can have, and
// refuses a run that would not fit, naming the rank, its pipeline stage and
// where the bytes go, and the nearest changes that would fit by the same
// estimate: a lighter activation-checkpointing mode, a smaller micro-batch,
// more pipeline stages, more FSDP ranks.
#pragma once
#include <cstddef>
#include <string>
#include <vector>

#include "anvil/model/args.h"
#include "anvil/train/config.h"
#include "anvil/train/estimate.h"
#include "anvil/train/parallel_dims.h"

namespace anvil {

// Processes of this job on this machine, from the launcher's environment
// (OpenMPI, MPICH/Hydra, Slurm); 1 when not launched by one.
int ranks_on_this_machine();

// Ranks sharing this machine share its cores: unless OMP_NUM_THREADS is set,
// each rank takes cores / ranks OpenMP threads (at least 1), as torchrun sets
// one thread per process. Threads beyond the cores spin against each other at
// every parallel region's barrier. A rank alone on its machine takes the cores
// other processes leave free (core/free_cores.h). Says so on stdout when it
// changes the count.
void share_cores_between_local_ranks();

// A change of the configuration and what the estimate says of it.
struct FitOption {
  std::string what;   // "activation_checkpoint.mode = \"full\" with 8 FSDP ranks"
  std::string flags;  // the command-line flags that make it
  int world_size = 1;
  size_t peak = 0;  // the fullest rank's predicted peak
};

// The changes, nearest first (those needing no more ranks, then by rank
// count), under which every rank's predicted peak is at most `per_rank`.
std::vector<FitOption> fitting_changes(const JobConfig& cfg, const ModelArgs& args, int world_size, size_t per_rank);

// Why `rank` (its estimate under the layout `par`) does not fit in
// `available` bytes shared by `local_ranks` processes: its predicted peak,
// where the bytes go, and the nearest changes that would fit
// (fitting_changes); "" when it fits or available is 0 (unknown). The
// refusal `anvil train` stops with and `anvil estimate`'s verdict.
std::string fit_refusal(const JobConfig& cfg, const ModelArgs& args, const ParallelDims& par, const RankEstimate& rank,
                        size_t available, int local_ranks);

// Why a job on one GPU, `rank` its dry run of the GPU path, does not fit
// `gpu`'s memory: the reserved peak, where the bytes go, and the lighter
// activation checkpointing or smaller micro-batch that would fit by the same
// dry run; "" when it fits (or the GPU's memory is unknown, 0).
std::string gpu_fit_refusal(const JobConfig& cfg, const ModelArgs& args, const RankEstimate& rank,
                            const DeviceProperties& gpu);

// This rank's estimate, after checking it against `available` bytes shared by
// `local_ranks` processes; throws anvil::Error, saying what would fit, when it
// does not fit. available = 0: unknown, nothing is checked.
RankEstimate check_rank_fits(const JobConfig& cfg, const ModelArgs& args, const ParallelDims& par, size_t available,
                             int local_ranks);

}  // namespace anvil
