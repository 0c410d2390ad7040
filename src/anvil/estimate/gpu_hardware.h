// The GPUs the cluster planner (estimate/gpu_estimate.h) knows: published figures
// only, each with its source beside it (and in docs/estimator.md). Two kinds:
// the datasheet's peaks (what MFU is measured against) and the rates kernels
// are measured to reach (what the step time is computed from). None of them
// comes from a torchtitan run. Nothing here describes the CPU Anvil itself
// runs on (that is core/cpu_peak.h).
#pragma once
#include <string>
#include <vector>

namespace anvil {

struct GpuHardware {
  std::string name;                // "a100-80g", ...
  std::string description;         // "NVIDIA A100 SXM4 80GB in a DGX A100"
  double peak_bf16_flops = 0;      // dense bf16 tensor-core FLOP/s (no sparsity): MFU's denominator
  double hbm_bytes = 0;            // memory capacity, bytes (published GB × 1e9)
  double hbm_bandwidth = 0;        // bytes/s, datasheet
  double nvlink_bandwidth = 0;     // bytes/s per GPU per direction (half the published bidirectional total)
  double internode_bandwidth = 0;  // bytes/s per GPU per direction: the node's compute NICs ÷ its GPUs
  int gpus_per_node = 0;
  int sms = 0;  // streaming multiprocessors: what GEMM tiles are scheduled on in waves

  // Achievable rates, each a published measurement (docs/estimator.md).
  double matmul_flops = 0;               // bf16 GEMM at its best shape (maximum achievable matmul FLOP/s)
  double flash_forward_efficiency = 0;   // FlashAttention-2 forward, fraction of the peak
  double flash_backward_efficiency = 0;  // and backward
  double hbm_efficiency = 0;             // fraction of hbm_bandwidth a streaming kernel reaches
  // The tensor cores' clock sustained at the power limit over the boost clock
  // the peaks (and short benchmarks) run at; 1 where no figure is published.
  double sustained_clock_ratio = 1;
};

// The measured behaviour of NCCL and eager PyTorch the planner uses for every
// GPU (published figures, docs/estimator.md).
struct GpuSoftware {
  double nvlink_efficiency;     // ring bus bandwidth ÷ NVLink per direction, inside a node
  double internode_efficiency;  // ring bus bandwidth ÷ the node's NIC bandwidth per GPU, across nodes
  double intranode_latency;     // seconds a small collective takes inside a node
  double internode_latency;     // ... across nodes
  int collective_sms;           // SMs one NCCL collective kernel occupies while it runs
  // All-to-all (expert parallelism's token exchange), nccl-tests' alltoall_perf:
  double alltoall_nvlink_efficiency;     // bus bandwidth ÷ NVLink per direction, inside a node
  double alltoall_internode_efficiency;  // bytes leaving the node ÷ (one NIC per GPU × time), across nodes
  // torch._grouped_mm (the experts' products) over the maximum achievable dense matmul rate.
  double grouped_gemm_efficiency;
  // Eager PyTorch's host (CPU) time, which paces a step whose kernels are
  // shorter than their dispatch (docs/estimator.md, "Short steps"):
  double host_seconds_per_op;            // one op through Python and the dispatcher, not counting a launch
  double host_seconds_per_launch;        // the CPU side of one kernel launch
  double host_seconds_per_backward_node; // the autograd engine evaluating one node, not counting a launch
  double host_seconds_per_accumulate;    // AccumulateGrad, one per parameter tensor in the backward
  double fsdp_hook_seconds;              // FSDP2: one group's unshard (pre-forward, pre-backward) or reduce (post-backward)
  double dtensor_optimizer_seconds_per_tensor;  // fused AdamW's step on FSDP2's DTensor parameters, per tensor
  double plain_optimizer_seconds_per_tensor;    // ... on plain tensors (no FSDP)
  double dtensor_op_seconds;             // one DTensor op (gradient clipping's per-tensor work under FSDP2)
};
const GpuSoftware& gpu_software();

// The entry named `name`; throws anvil::Error listing the known names.
const GpuHardware& gpu_hardware(const std::string& name);
std::vector<std::string> known_gpu_hardware();

}  // namespace anvil
