// The bytes each rank sends per optimizer step under a data-parallel layout,
// in closed form (the formulas of comm_bytes in comm.h applied to the model's
// parameter groups), for the startup summary, the metrics and the benchmark to
// set the measured traffic against.
#pragma once
#include <cstdint>
#include <vector>

#include "anvil/distributed/fsdp.h"

namespace anvil {

// DDP over n ranks: every group's fp32 gradients all-reduced once per step
// (only the last micro-batch synchronises).
double ddp_bytes_per_step(const std::vector<ParamGroup>& groups, int n);

// FSDP over n shards, per micro-batch: each group's compute weights gathered
// for the forward and again for the backward unless still held (the head, and
// the last block under the default policy, or every group under "never"), and
// its fp32 gradients reduce-scattered; HSDP adds an all-reduce of the fp32
// gradient shard over r replicas once per step.
// micro_batches: the forward-backward passes per step (accumulation steps, times
// the pipeline's micro-batches under pipeline parallelism). gather_once: the
// weights are held for the step (FsdpParams::hold_gathered_for_step), one
// all-gather per group per step. expert_n: the ranks sharding a group's
// expert weights (FsdpParams), which are gathered and reduced over them apart.
double fsdp_bytes_per_step(const std::vector<ParamGroup>& groups, int n, int replicas, int compute_dtype_bytes,
                           ReshardPolicy reshard, int64_t micro_batches, bool gather_once = false, int expert_n = 1);

}  // namespace anvil
