#include "anvil/estimate/gpu_hardware.h"

#include "anvil/core/error.h"

namespace anvil {

namespace {

// Sources (also listed in docs/estimator.md). Datasheets:
//  [A100]  NVIDIA A100 Tensor Core GPU datasheet, SXM column: BF16 tensor core 312 TFLOPS (624 with
//          sparsity); 40GB HBM2 1,555 GB/s; 80GB HBM2e 2,039 GB/s; NVLink 600 GB/s. 108 SMs (A100 whitepaper).
//  [DGXA]  NVIDIA DGX A100 datasheet / user guide (DU-09821-001): 8 A100 GPUs; 8 single-port
//          ConnectX-6 200 Gb/s HDR InfiniBand adapters for the compute fabric (one per GPU).
//  [H100]  NVIDIA H100 Tensor Core GPU datasheet, SXM5 column: BF16 tensor core 1,979 TFLOPS with
//          sparsity, so 989 dense; 80GB HBM3 3.35 TB/s; NVLink 900 GB/s. 132 SMs (H100 whitepaper).
//  [DGXH]  NVIDIA DGX H100 datasheet / user guide: 8 H100 GPUs; 8 ConnectX-7 400 Gb/s NDR
//          InfiniBand ports for the compute fabric (one per GPU).
//  [H200]  NVIDIA H200 Tensor Core GPU datasheet, SXM column: BF16 1,979 TFLOPS with sparsity
//          (989 dense); 141GB HBM3e 4.8 TB/s; NVLink 900 GB/s; the H100's GH100 die (132 SMs).
//          DGX H200: as DGX H100 [DGXH].
// NVLink figures are bidirectional totals: per direction is half. InfiniBand: 200 Gb/s = 25 GB/s and
// 400 Gb/s = 50 GB/s per direction.
// Measured rates:
//  [MAMF]  S. Bekman, "Machine Learning Engineering", compute/accelerator/README.md, "Maximum
//          Achievable Matmul FLOPS comparison table" (bf16 matmul, best shape found by mamf-finder.py):
//          A100 SXM 267.9 TFLOPS (85.9%, CUDA 12.1), H100 SXM 792.1 (80.1%, CUDA 12.1). H200 takes the
//          H100's figure: the same die, clocks and power limit, and a compute-bound GEMM does not
//          see the faster memory.
//  [FA2]   T. Dao, "FlashAttention-2", arXiv:2307.08691, Introduction: "reaching up to 73% of the
//          theoretical max throughput in the forward pass, and up to 63% of the theoretical max
//          throughput in the backward pass" (A100); section 4.1: "we obtain up to 335 TFLOPs/s"
//          forward + backward on H100, 34% of 989.
//  [HBM]   A read kernel on an A100 80GB SXM reaching 1.80 of the 2.04 TB/s (88%, Nsight Compute
//          agreeing), and "the maximum memory bandwidth achieved by any kernel was around 90%" in
//          NVIDIA's GTC talk it cites: forums.developer.nvidia.com/t/trouble-to-reach-peak-bandwidth-
//          of-a100/339083. 0.88 for every GPU.
//  [CLK]   G. Lockwood, "Peak FLOPS" (glennklockwood.com/garden/peak-FLOPS): NVIDIA computes the A100's
//          HPL Rpeak at "the clock that can be sustained at a GPU's power limit while running HPL (e.g.,
//          1305 MHz for A100)", against its 1410 MHz boost clock: 0.926 for a run that keeps the tensor
//          cores busy for hours. No such figure was found for the H100 or H200: 1.
const std::vector<GpuHardware>& table() {
  static const std::vector<GpuHardware> t = {
      {"h100-80g", "NVIDIA H100 SXM5 80GB (DGX H100: NVLink 4, 8x400 Gb/s NDR)", 989e12, 80e9, 3.35e12, 450e9, 50e9, 8,
       132, 792.1e12, 0.34, 0.34, 0.88, 1.0},
      {"a100-80g", "NVIDIA A100 SXM4 80GB (DGX A100: NVLink 3, 8x200 Gb/s HDR)", 312e12, 80e9, 2.039e12, 300e9, 25e9, 8,
       108, 267.9e12, 0.73, 0.63, 0.88, 1305.0 / 1410.0},
      {"a100-40g", "NVIDIA A100 SXM4 40GB (DGX A100: NVLink 3, 8x200 Gb/s HDR)", 312e12, 40e9, 1.555e12, 300e9, 25e9, 8,
       108, 267.9e12, 0.73, 0.63, 0.88, 1305.0 / 1410.0},
      {"h200", "NVIDIA H200 SXM 141GB (DGX H200: NVLink 4, 8x400 Gb/s NDR)", 989e12, 141e9, 4.8e12, 450e9, 50e9, 8, 132,
       792.1e12, 0.34, 0.34, 0.88, 1.0},
  };
  return t;
}

}  // namespace

// [NCCL]  S. Bekman, "Machine Learning Engineering", network/benchmarks/README.md (all_reduce_bench.py
//         and nccl-tests tables): one 8 x H200 node, ring (NVLS off), 365.6 GB/s bus bandwidth at
//         8 GiB against NVLink 4's 450 GB/s per direction (0.81); four 8 x B200 nodes, 376.71 GB/s at
//         16 GiB against their 8 x 400 Gb/s NICs' 400 GB/s per node (0.94); the smallest payload
//         (32 KiB) all-reduced in 18 us on one node (3.15 GB/s bus bandwidth on 8 ranks) and in 98 us
//         across four nodes (0.65 GB/s on 32 ranks).
// [SMS]   An H100 profile of FSDP's prefetch pattern (a GEMM beside ncclAllGather) shows the
//         all-gather kernel launching 24 blocks, one per SM, for as long as it runs:
//         forums.developer.nvidia.com/t/compute-communication-overlap-causes-severe-gemm-performance-
//         degradation-because-of-tail-effect/337991.
// [A2A]   NVIDIA, GTC25 session S72583 (nvidia.com/en-us/on-demand/session/gtc25-s72583), slide "All-to-all
//         Communication Bandwidth" (reproduced in stas00/ml-engineering network/README.md): nccl-tests
//         alltoall bus bandwidth 320 GB/s on 8 H100s (NVLink 4: 0.71 of 450 GB/s; the A100's 210 of 300
//         agrees) and 48 GB/s on 32 H100s of DGX H100s (8 x 400 Gb/s). nccl-tests' alltoall busbw is
//         algbw x (n - 1)/n; across N nodes the (N - 1)/N of the buffer that leaves the node goes through
//         the GPU's own NIC (all-to-all cannot stripe over NICs, NVIDIA/nccl-tests#267): 48 x (31/32) /
//         (3/4) = 62 GB/s of a 50 GB/s NIC would be 1.24, so the NIC is reached at 48 x (3/4) / (50 x
//         31/32) = 0.74 of its rate (the A100's 24 GB/s on 25 GB/s NICs gives the same 0.74).
// [GMM]   torch._grouped_mm on an H100, 16 experts, 8192 tokens (512 an expert on average), K 5120,
//         N 8192: 1.31 ms (pytorch/ao PR #2490), 2·8192·5120·8192 / 1.31 ms = 524 TFLOP/s, 0.66 of the
//         H100's maximum achievable dense matmul rate [MAMF]. No A100 figure: the same ratio.
// Eager PyTorch's host time (docs/estimator.md, "Short steps", derives the per-step counts):
// [BRRR]  H. He, "Making Deep Learning Go Brrrr From First Principles" (horace.io/brrr_intro.html):
//         "with PyTorch, we can only get 280 thousand operations per second": 3.6 us an op.
// [HTA]   Meta's Holistic Trace Analysis docs, "CUDA kernel launch stats": "Usually, the launch time on
//         the CPU side is between 5-20 microseconds": the middle, 12.5 us a launch.
// [NODE]  A torch.profiler table of an FSDP training step (https://github.com/huggingface/blog/issues/1649):
//         "autograd::engine::evaluate_function: ViewBackward0 ... 13.902us" per node and
//         "torch::autograd::AccumulateGrad ... 7.717us".
// [FSDP2] the PyTorch report "Large CPU overhead with FSDP2" (torch 2.10,
//         https://github.com/pytorch/pytorch/issues/173680): "FSDP::pre_forward calls take 50% of the
//         step time ... 1 ms launches": 1 ms a group's unshard; the post-backward reduce, which walks the
//         group's parameters as the unshard does, is taken at the same.
// [OPT]   The Dion optimizer's change to fused AdamW (https://github.com/microsoft/dion/pull/63): "With ~150
//         AdamW params ... torch.optim.AdamW(fused=True) dropped the same work to ~43 ms of CPU" (DTensor
//         parameters): 0.287 ms a tensor; and the PyTorch report that AdamW is slower under FSDP2
//         (https://github.com/pytorch/pytorch/issues/134191): "uncompiled AdamW + FSDP1 ... 6 ms on CPU /
//         uncompiled AdamW + FSDP2 ... 187 ms on CPU": plain tensors at 6/187 of the DTensor cost.
// [DT]    PyTorch's DTensor dispatch fast path (https://github.com/pytorch/pytorch/pull/166371): "reduce
//         DTensor dispatch time for detach() from 36-40 usec to 24-26 usec": 25 us a DTensor op.
const GpuSoftware& gpu_software() {
  static const GpuSoftware s{.nvlink_efficiency = 365.6 / 450,
                             .internode_efficiency = 376.71 / 400,
                             .intranode_latency = 18e-6,
                             .internode_latency = 98e-6,
                             .collective_sms = 24,
                             .alltoall_nvlink_efficiency = 320.0 / 450.0,
                             .alltoall_internode_efficiency = 48.0 * (3.0 / 4.0) / (50.0 * 31.0 / 32.0),
                             .grouped_gemm_efficiency = (2.0 * 8192 * 5120 * 8192 / 1.31e-3) / 792.1e12,
                             .host_seconds_per_op = 3.6e-6,
                             .host_seconds_per_launch = 12.5e-6,
                             .host_seconds_per_backward_node = 13.9e-6,
                             .host_seconds_per_accumulate = 7.7e-6,
                             .fsdp_hook_seconds = 1e-3,
                             .dtensor_optimizer_seconds_per_tensor = 43e-3 / 150,
                             .plain_optimizer_seconds_per_tensor = 43e-3 / 150 * 6.0 / 187.0,
                             .dtensor_op_seconds = 25e-6};
  return s;
}

std::vector<std::string> known_gpu_hardware() {
  std::vector<std::string> out;
  for (const GpuHardware& h : table()) out.push_back(h.name);
  return out;
}

const GpuHardware& gpu_hardware(const std::string& name) {
  for (const GpuHardware& h : table())
    if (h.name == name) return h;
  std::string known;
  for (const GpuHardware& h : table()) known += (known.empty() ? "" : ", ") + h.name;
  throw Error("unknown GPU hardware '" + name + "'; known: " + known + " (--hardware NAME)");
}

}  // namespace anvil
