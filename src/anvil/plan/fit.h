// What fits: the per-rank memory estimate when FSDP (and tensor parallelism)
// split the model state, and the fewest FSDP ranks that would fit a run that
// a single process cannot hold.
#pragma once
#include <cstdint>

#include "anvil/plan/memory.h"

namespace anvil {

// Each of `shards` ranks keeps 1/shards of the weights, gradients and optimizer
// state; activations and workspace depend on the local batch and stay whole.
MemoryEstimate shard_model_state(MemoryEstimate est, int64_t shards);

// The fewest FSDP ranks, each with `available` bytes, whose per-rank estimate
// fits `shape`; 0 when no number does (the activations alone exceed it).
int64_t fsdp_ranks_to_fit(const ModelArgs& args, const TrainShape& shape, size_t available);

}  // namespace anvil
