// Tensor parallelism's communication: the model's TensorParallel collectives
// over the mesh's tp communicator, and the two places outside the model where
// tp ranks must cooperate — checkpoints (global tensors gathered from the
// ranks' slices) and the gradient norm (each global element counted once).
#pragma once
#include <vector>

#include "anvil/dist/comm.h"
#include "anvil/dist/fsdp.h"
#include "anvil/model/params.h"
#include "anvil/model/tensor_parallel.h"

namespace anvil {

class CommTensorParallel : public TensorParallel {
 public:
  // tp: the tp group's communicator (not owned); its rank and size are the model's.
  CommTensorParallel(Communicator& tp, Options options);
  void all_reduce_sum(const Tensor& t) override;
  void all_reduce_max(const Tensor& t) override;
  void all_gather(const Tensor& shard, const Tensor& full) override;
  void reduce_scatter(const Tensor& full, const Tensor& shard) override;

 private:
  Communicator& comm_;
};

// The global flat buffer, laid out as global_specs (with ParamStore's offsets),
// of a per-parameter fp32 state (master weights or an AdamW moment) that every
// tp rank holds as local_flat, laid out as its local_specs. Collective over tp:
// sharded parameters are all-gathered and assembled, replicated ones copied.
Tensor gather_tp_global(Communicator& tp, const std::vector<ParamSpec>& local_specs, const Tensor& local_flat,
                        const std::vector<ParamSpec>& global_specs, int64_t global_numel);

// The pieces of this rank's gradients that a global norm counts, such that
// the sum of squares over them, summed over the tp group (and, under FSDP,
// over dp_shard), counts every element of the global gradient exactly once:
// sharded parameters' pieces on every tp rank (each holds different
// elements), replicated parameters (the norms) on tp rank 0 only (every rank
// holds the same values). grads is the local model's flat gradient buffer laid
// out as `params`, or, when fsdp is given, this rank's FSDP shard of it
// (dp_shard_rank being this rank's place in the shard group).
std::vector<Tensor> grads_counted_once(const ParamStore& params, const Tensor& grads, int tp_rank,
                                       const FsdpParams* fsdp = nullptr, int dp_shard_rank = 0);

}  // namespace anvil
