// Megatron-style tensor parallelism, the model's side of it: the context a
// Llama runs under (this rank's place in the tensor-parallel group, whether
// the sequence and the loss are parallel, and the group's collectives), and
// the mapping between a rank's parameter slices and the global tensors.
//
// The collectives are an interface, implemented over a communicator by
// dist/tensor_parallel.h, so the model (and every kernel) stays free of MPI:
// the model calls them at explicit seams between kernels, never inside one.
#pragma once
#include <vector>

#include "anvil/core/tensor.h"
#include "anvil/model/params.h"

namespace anvil {

class TensorParallel {
 public:
  struct Options {
    // Shard the residual stream and the norms over the token rows (M/tp rows
    // per rank) instead of replicating them: all-gather before the
    // column-parallel products, reduce-scatter after the row-parallel ones.
    bool sequence_parallel = true;
    // Cross-entropy over the vocabulary shards (combining per-row max and
    // sums) instead of gathering the whole output weight on every rank.
    bool loss_parallel = true;
  };
  TensorParallel(int rank, int size, Options options) : rank_(rank), size_(size), options_(options) {}
  virtual ~TensorParallel() = default;
  TensorParallel(const TensorParallel&) = delete;
  TensorParallel& operator=(const TensorParallel&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  bool sequence_parallel() const { return options_.sequence_parallel; }
  bool loss_parallel() const { return options_.loss_parallel; }

  // Collectives over the tensor-parallel group, blocking; every rank of the
  // group calls them in the same order. f32 or bf16 (bf16 sums accumulate in
  // fp32 and round once).
  virtual void all_reduce_sum(const Tensor& t) = 0;  // in place
  virtual void all_reduce_max(const Tensor& t) = 0;  // in place
  // full (size·k, ...) ← the ranks' shards (k, ...) in rank order.
  virtual void all_gather(const Tensor& shard, const Tensor& full) = 0;
  // shard (k, ...) ← Σ over ranks of full's rows [rank·k, (rank+1)·k).
  virtual void reduce_scatter(const Tensor& full, const Tensor& shard) = 0;

 private:
  int rank_, size_;
  Options options_;
};

// A padded vocabulary: the smallest multiple of tp holding vocab_size, so every
// rank's embedding and output shard has the same number of rows (collectives
// and FSDP's flat shards need equal pieces). The padding rows are zero, receive
// no gradient (no token id reaches them, and the loss kernels are given only
// the real rows) and are dropped from checkpoints.
int64_t padded_vocab_size(int64_t vocab_size, int tp);

// For tensor parallelism's checkpoints, which hold global tensors by name.
// local (spec.shape) ← this rank's slice of global (spec.global_shape()); padding zeroed.
void copy_global_to_local(const ParamSpec& spec, const Tensor& global, const Tensor& local);
// global (spec.global_shape()) ← the tp ranks' local tensors stacked in rank
// order, stacked (tp, spec.numel()); `spec` is any rank's spec of the
// parameter (the ranks' slices differ only in where they begin).
void assemble_global(const ParamSpec& spec, int tp, const Tensor& stacked, const Tensor& global);

// The flat buffers of a whole model (laid out as ParamStore lays out `specs`)
// converted between a rank's local layout and the global one, parameter by
// parameter. global_specs and local_specs list the same names in the same order.
void global_flat_to_local(const std::vector<ParamSpec>& global_specs, const Tensor& global_flat,
                          const std::vector<ParamSpec>& local_specs, const Tensor& local_flat);

}  // namespace anvil
