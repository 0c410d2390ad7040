// The planner's search (anvil plan): every torchtitan layout of N GPUs for a
// model and sequence length — FSDP/HSDP, TP, CP, PP degrees, AC mode, local and
// micro-batch size — estimated with estimate/gpu_estimate.h, the ones that fit
// ranked by predicted tokens/s per GPU.
#pragma once
#include <cstdint>
#include <vector>

#include "anvil/estimate/gpu_estimate.h"

namespace anvil {

struct GpuPlanRow {
  GpuRunSpec spec;
  GpuStepEstimate estimate;
};

struct GpuPlanResult {
  std::vector<GpuPlanRow> rows;  // the layouts that fit, fastest first
  int64_t tried = 0;             // how many layouts were estimated
};

// `base` gives the model, sequence length and era; its layout, AC and batch
// fields are what the search varies: TP 1, 2, 4, 8 within a node (dividing the
// heads and KV heads), CP 1, 2, 4, ... while each rank keeps at least 1024
// tokens of a sequence, PP 1, 2, 4, ... (1F1B, at least two blocks per stage,
// micro-batches of 1, 2, 4, ... sequences, at least as many as stages), HSDP
// replicas in powers of two leaving FSDP (dp_shard × cp) at least 2 ranks, AC
// none, selective op, selective every 2nd block, full, and local batch 1 to 16.
GpuPlanResult search_gpu_layouts(const GpuRunSpec& base, const GpuHardware& hw, int64_t gpus);

}  // namespace anvil
