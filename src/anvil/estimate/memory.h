// The memory estimator: predicts, before anything is allocated, the peak bytes
// of each category for one training process, from the model shape, the batch,
// the compute dtype and the activation-checkpointing policy. docs/memory.md
// derives the formulas; tests hold them against the tracking allocator.
#pragma once
#include <array>
#include <cstdint>
#include <string>

#include "anvil/core/allocator.h"
#include "anvil/model/args.h"
#include "anvil/model/llama.h"

namespace anvil {

struct MemoryEstimate {
  std::array<size_t, kNumMemCategories> peak{};  // per category
  size_t peak_total = 0;  // parameters + gradients + optimizer state + activation peak + workspace
  // What the process holds for tensors at its fullest, the allocator's block
  // cache included (MemStats::peak_reserved); 0 where not estimated.
  size_t peak_reserved = 0;
  size_t bytes(MemCategory c) const { return peak[static_cast<int>(c)]; }
};

struct TrainShape {
  int64_t local_batch_size = 1;  // sequences per micro-batch
  int64_t seq_len = 1;
  DType compute_dtype = DType::bf16;
  AcPolicy ac;
  int64_t micro_batches = 1;  // the trainer holds every micro-batch's tokens of a step
  int threads = 0;            // threads running the ops (attention's scratch is per thread); 0: num_threads()
};

MemoryEstimate estimate_memory(const ModelArgs& args, const TrainShape& shape);

// Activation bytes one block keeps between forward and backward under `policy`
// (layer index matters for selective-layer checkpointing).
size_t block_saved_bytes(const ModelArgs& args, const TrainShape& shape, int layer);

// Bytes of memory this process may use: MemAvailable from /proc/meminfo, or the
// cgroup limit minus current usage when that is lower.
size_t available_memory_bytes();

}  // namespace anvil
