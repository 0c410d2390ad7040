// AdamW over this rank's master weights — the model's own, or its FSDP shard
// — as every layout runs it: the two fp32 moments are created at the first
// step (as in PyTorch, so the first forward and backward run without them) or
// by a resume, and the bf16 compute copy is written in the same pass.
#pragma once
#include <cstdint>

#include "anvil/core/tensor.h"
#include "anvil/ops/adamw.h"

namespace anvil {

class RankOptimizer {
 public:
  // `master`: the fp32 weights this rank updates; `compute_copy`: their bf16
  // copy in mixed precision, or null. Both outlive the optimizer.
  RankOptimizer(Tensor& master, Tensor* compute_copy) : master_(master), compute_copy_(compute_copy) {}

  // One step on `grads` (shaped as the master weights), scaled by `clip`.
  void step(const AdamWConfig& adamw, int64_t step, const Tensor& grads, float clip);
  // The moments, zero (a resume fills them).
  void create_state();
  bool has_state() const { return exp_avg_.defined(); }
  Tensor& exp_avg() { return exp_avg_; }
  Tensor& exp_avg_sq() { return exp_avg_sq_; }

 private:
  Tensor& master_;
  Tensor* compute_copy_;
  Tensor exp_avg_, exp_avg_sq_;
};

}  // namespace anvil
