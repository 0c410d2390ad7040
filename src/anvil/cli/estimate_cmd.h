// `anvil estimate CONFIG [--section.key value ...] [--ranks N] [--json]`: the
// predicted peak memory of every rank of a run, per category, under the
// configured layout (train/estimate.h), its FLOPs per token and
// communication per step, and the verdict: whether it fits this machine, as
// `anvil train`'s pre-flight check judges (train/preflight.h); no MPI and no
// data needed. With --hardware and --gpus, the GPU-cluster planner's
// prediction instead (plan_cmd.h).
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "anvil/train/estimate.h"

namespace anvil {

struct EstimateOptions {
  std::vector<std::string> config_args;  // what parse_config reads
  int ranks = 0;                         // 0: the product of the configured degrees
  bool json = false;
  std::string hardware;                  // a GPU planner run when set
  int64_t gpus = 0;
  std::string calibration;               // the GPU planner's rates measured on the user's GPU (gpu_calibration.h)
  double mean_document_tokens = 0;       // the GPU planner's block-causal documents (GpuRunSpec); 0: causal work
};

// Parses the words after `anvil estimate`; throws anvil::Error on bad usage.
EstimateOptions parse_estimate_args(const std::vector<std::string>& args);

// The world size a configuration implies when no --ranks is given: the
// product of its degrees, data_parallel_shard_degree = -1 counting as 1.
int implied_world_size(const JobConfig& cfg);

// The estimate as JSON: {"model", "world_size", "layout", "ranks": [{"rank",
// "pp_rank", "pp_stages", "peak_bytes", "by_category": {...}}],
// "flops_per_token", "comm_bytes_per_step": {...}}; the command adds its
// verdict on this machine ("available_bytes", "ranks_on_this_machine",
// "fits_this_machine", "verdict").
nlohmann::ordered_json layout_estimate_json(const LayoutEstimate& est, const ModelArgs& args, int64_t seq_len);

int estimate_command(const std::vector<std::string>& args);

}  // namespace anvil
