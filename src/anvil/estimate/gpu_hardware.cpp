#include "anvil/estimate/gpu_hardware.h"

#include "anvil/core/error.h"

namespace anvil {

namespace {

// Sources (also listed in docs/estimator.md):
//  [A100]  NVIDIA A100 Tensor Core GPU datasheet (nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/
//          pdf/nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf), SXM column: BF16 tensor core 312 TFLOPS
//          (624 with sparsity); 40GB HBM2 1,555 GB/s; 80GB HBM2e 2,039 GB/s; NVLink 600 GB/s.
//  [DGXA]  NVIDIA DGX A100 datasheet / user guide (DU-09821-001): 8 A100 GPUs; 8 single-port
//          ConnectX-6 200 Gb/s HDR InfiniBand adapters for the compute fabric (one per GPU).
//  [H100]  NVIDIA H100 Tensor Core GPU datasheet, SXM5 column: BF16 tensor core 1,979 TFLOPS with
//          sparsity, so 989 dense; 80GB HBM3 3.35 TB/s; NVLink 900 GB/s.
//  [DGXH]  NVIDIA DGX H100 datasheet / user guide: 8 H100 GPUs; 8 ConnectX-7 400 Gb/s NDR
//          InfiniBand ports for the compute fabric (one per GPU).
//  [H200]  NVIDIA H200 Tensor Core GPU datasheet, SXM column: BF16 1,979 TFLOPS with sparsity
//          (989 dense); 141GB HBM3e 4.8 TB/s; NVLink 900 GB/s. DGX H200: as DGX H100 [DGXH].
//  [FA2]   Tri Dao, "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning",
//          arXiv:2307.08691 (2023), abstract: "reaching 50-73% of the theoretical maximum FLOPs/s on
//          A100". The planner takes the upper end, 0.73 (so its step time is a lower bound).
//  [FA3]   Shah et al., "FlashAttention-3", arXiv:2407.08608 (2024), abstract: "FlashAttention-2
//          achieving only 35% utilization on the H100 GPU": 0.35 on H100 and H200 (same SMs).
// NVLink figures are bidirectional totals: per direction is half. InfiniBand: 200 Gb/s = 25 GB/s and
// 400 Gb/s = 50 GB/s per direction.
const std::vector<GpuHardware>& table() {
  static const std::vector<GpuHardware> t = {
      {"h100-80g", "NVIDIA H100 SXM5 80GB (DGX H100: NVLink 4, 8x400 Gb/s NDR)", 989e12, 80e9, 3.35e12, 450e9, 50e9, 8,
       0.35},
      {"a100-80g", "NVIDIA A100 SXM4 80GB (DGX A100: NVLink 3, 8x200 Gb/s HDR)", 312e12, 80e9, 2.039e12, 300e9, 25e9, 8,
       0.73},
      {"a100-40g", "NVIDIA A100 SXM4 40GB (DGX A100: NVLink 3, 8x200 Gb/s HDR)", 312e12, 40e9, 1.555e12, 300e9, 25e9, 8,
       0.73},
      {"h200", "NVIDIA H200 SXM 141GB (DGX H200: NVLink 4, 8x400 Gb/s NDR)", 989e12, 141e9, 4.8e12, 450e9, 50e9, 8,
       0.35},
  };
  return t;
}

}  // namespace

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
