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
// tokens of a sequence (both rotations, all-gather and ring), PP 1, 2, 4, ...
// under every named schedule (GPipe, 1F1B, and two stages per rank for the
// looped and V ones; at least two blocks per stage; micro-batches of 1, 2, 4,
// ... sequences, at least as many as pipeline ranks), HSDP replicas in powers
// of two leaving FSDP (dp_shard × cp) at least 2 ranks, AC none, selective op,
// selective every 2nd block, full, local batch 1 to 16 and gradient
// accumulation 1, 2, 4 over it.
// With `cal`, every layout is priced with its rates (estimate_gpu_run).
GpuPlanResult search_gpu_layouts(const GpuRunSpec& base, const GpuHardware& hw, int64_t gpus,
                                 const GpuCalibration* cal = nullptr);

// One row per layout (its parallel degrees, CP rotation and pipeline
// schedule), fastest first: what differs only in batch, AC or accumulation is
// one choice of layout. Each layout's row is its fastest, or, within 1% of
// that, the one with the smallest global batch. `rows` as the search returns them.
std::vector<GpuPlanRow> distinct_layouts(const std::vector<GpuPlanRow>& rows);
// The fastest row under each pipeline schedule that has one, fastest first.
std::vector<GpuPlanRow> fastest_per_schedule(const std::vector<GpuPlanRow>& rows);

}  // namespace anvil
