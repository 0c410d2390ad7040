// Where a job trains (job.device), and what a job on a GPU may be for now:
// one process, a dense model, causal attention. Anything else is refused
// before anything is built, with one line naming the key to change.
#pragma once
#include <cstddef>
#include <string>

#include "anvil/core/cpu_peak.h"
#include "anvil/core/device.h"
#include "anvil/model/args.h"
#include "anvil/train/config.h"

namespace anvil {

// The GPUs this process can train on: 0, with the reason in *why_none, for a
// binary built without CUDA or a machine without a visible GPU.
int visible_gpus(std::string* why_none);

// job.device as a device: the host for cpu; the first GPU for cuda, and for
// auto where there is one (visible_gpus; else the host, and *why_cpu says
// why). cuda without a GPU throws anvil::Error saying why.
Device job_device(const JobConfig& cfg, std::string* why_cpu = nullptr);

// Throws anvil::Error for what a GPU cannot run yet: several ranks, mixtures
// of experts.
void check_gpu_job(const ModelArgs& args, int world_size);

// MFU's peak on the GPU its driver names `name` ("NVIDIA H200"): the dense
// bf16 tensor-core peak of the planner's entry for it (estimate/gpu_hardware.h),
// or 0 FLOP/s, the derivation saying so, for a GPU without one.
PeakFlops gpu_peak_flops(const std::string& name);

// The fake device a dry run of a GPU job allocates from: large enough that
// the dry run of any job runs to its end (its peaks say whether it fits).
inline constexpr size_t kDryRunGpuBytes = size_t{1} << 40;

}  // namespace anvil
