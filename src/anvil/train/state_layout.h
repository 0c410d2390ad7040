// Where this rank's part of the model's per-parameter fp32 state — master
// weights, gradients, the optimizer's state — sits in the whole model's global
// tensors, which checkpoints and Hugging Face folders hold. A rank's state
// lies as the weights its optimizer updates; from the inside out:
//
//   its FSDP shard  ⊂  this tp rank's slices of its stages  ⊂  its stages'
//   global tensors  ⊂  the whole model.
//
// to_global walks the chain outwards (gathers over dp_shard, tp, then pp),
// from_global inwards (each rank reads the whole model and keeps its part, so
// no communication), and global_sum_of_squares counts every global element
// once (the gradient norm). Saves, loads and the norm share this one layout,
// so they cannot disagree about which rank holds what.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "anvil/core/tensor.h"
#include "anvil/model/args.h"
#include "anvil/model/llama.h"
#include "anvil/model/params.h"
#include "anvil/train/parallel_dims.h"

namespace anvil {

class FsdpParams;

// The module ranges of this rank's pipeline stages; the whole model as one
// range without pipeline parallelism.
std::vector<ModuleRange> rank_stages(const ModelArgs& args, const ParallelDims& par);

class RankStateLayout {
 public:
  // local: the model's parameter store on this rank (its stages, its tp
  // slices when tensor_parallel); fsdp: its shards, when FSDP holds the
  // weights (else null). Both outlive the layout.
  RankStateLayout(const ModelArgs& args, const ParallelDims& par, const ParamStore& local, FsdpParams* fsdp,
                  bool tensor_parallel);
  ~RankStateLayout();

  // The whole model's parameters as checkpoints store them, laid out as a
  // ParamStore lays them out, and their flat buffer's length.
  const std::vector<ParamSpec>& global_specs() const;
  int64_t global_numel() const;
  // True when a rank's state is the whole model's as it stands (one process,
  // DDP): loads read straight into it, with no staging copy.
  bool is_global() const { return !fsdp_ && !tensor_parallel_ && par_.pp_size == 1 && par_.ep_size == 1; }

  // rank_state as the whole model's flat buffer, on pp rank 0 (undefined on
  // the other pp ranks; on every one under expert parallelism). Collective over
  // dp_shard, tp, the ep group and pp.
  Tensor to_global(const Tensor& rank_state) const;
  // rank_state ← this rank's part of `global`, a whole-model flat buffer.
  void from_global(const Tensor& global, Tensor& rank_state) const;
  // rank_state ← this rank's part of `local`, laid out as the model's
  // parameter store on this rank (its FSDP shard, or all of it).
  void from_local(const Tensor& local, Tensor& rank_state) const;
  // Σx² over the global tensor of which rank_state is this rank's part, each
  // global element counted once, the same on every rank. Collective over
  // dp_shard, tp and pp (and the ep group under expert parallelism over DDP).
  double global_sum_of_squares(const Tensor& rank_state) const;

 private:
  ModelArgs args_;
  const ParallelDims& par_;
  const ParamStore& local_;
  FsdpParams* fsdp_;
  bool tensor_parallel_;
  // Specs only, nothing allocated: this rank's stages' global tensors, and
  // the whole model's.
  std::unique_ptr<ParamStore> stage_global_, whole_;
};

}  // namespace anvil
