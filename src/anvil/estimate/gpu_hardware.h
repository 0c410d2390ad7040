// The GPUs the cluster planner (estimate/gpu_estimate.h) knows: published figures
// only, each with its source beside it (and in docs/estimator.md). The
// planner models a torchtitan run on these machines; nothing here describes
// the CPU Anvil itself runs on (that is core/cpu_peak.h).
#pragma once
#include <string>
#include <vector>

namespace anvil {

struct GpuHardware {
  std::string name;                // "a100-80g", ...
  std::string description;         // "NVIDIA A100 SXM4 80GB in a DGX A100"
  double peak_bf16_flops = 0;      // dense bf16 tensor-core FLOP/s (no sparsity)
  double hbm_bytes = 0;            // memory capacity, bytes (published GB × 1e9)
  double hbm_bandwidth = 0;        // bytes/s
  double nvlink_bandwidth = 0;     // bytes/s per GPU per direction (half the published bidirectional total)
  double internode_bandwidth = 0;  // bytes/s per GPU per direction: the node's compute NICs ÷ its GPUs
  int gpus_per_node = 0;
  // The fraction of peak attention reaches (PyTorch's SDPA flash backend is
  // FlashAttention-2): published figures, the only efficiency the planner uses.
  double attention_efficiency = 1;
};

// The entry named `name`; throws anvil::Error listing the known names.
const GpuHardware& gpu_hardware(const std::string& name);
std::vector<std::string> known_gpu_hardware();

}  // namespace anvil
