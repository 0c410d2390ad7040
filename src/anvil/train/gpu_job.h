// What a job on a GPU may be, for now: one process, a dense model, causal
// attention. Anything else is refused before anything is built, with one line
// naming the key to change. (The trainer does not take a GPU yet; the dry run
// of the GPU path, train/estimate.h, does.)
#pragma once
#include <cstddef>

#include "anvil/model/args.h"
#include "anvil/train/config.h"

namespace anvil {

// Throws anvil::Error for what a GPU cannot run yet: several ranks, mixtures
// of experts, block-causal attention.
void check_gpu_job(const JobConfig& cfg, const ModelArgs& args, int world_size);

// The fake device a dry run of a GPU job allocates from: large enough that
// the dry run of any job runs to its end (its peaks say whether it fits).
inline constexpr size_t kDryRunGpuBytes = size_t{1} << 40;

}  // namespace anvil
