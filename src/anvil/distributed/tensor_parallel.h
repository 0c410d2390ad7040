// Megatron-style tensor parallelism (Shoeybi et al. 2019; sequence
// parallelism: Korthikanti et al. 2022), applied to the model from outside:
// TensorParallelStyle is the model's ParallelStyle for a tp rank — which slice
// of each parameter the rank holds, and the collectives over the tp group at
// the seams between kernels — and the functions below are the places outside
// the model where tp ranks cooperate: checkpoints (global tensors gathered
// from, and sliced to, the ranks' slices) and the gradient norm (each global
// element counted once).
#pragma once
#include <vector>

#include "anvil/distributed/comm.h"
#include "anvil/distributed/fsdp.h"
#include "anvil/model/args.h"
#include "anvil/model/moe_feed_forward.h"
#include "anvil/model/parallel_style.h"
#include "anvil/model/params.h"

namespace anvil {

struct TensorParallelOptions {
  // Shard the residual stream and the norms over the token rows (M/tp rows
  // per rank) instead of replicating them: all-gather before the
  // column-parallel products, reduce-scatter after the row-parallel ones.
  bool sequence_parallel = true;
  // Cross-entropy over the vocabulary shards (combining per-row max and
  // sums) instead of gathering the whole output weight on every rank.
  bool loss_parallel = true;
};

// The parameters, by Hugging Face name (Megatron's layout):
//   q_proj, k_proj, v_proj, gate_proj, up_proj   column-parallel: output rows split
//                                                (q: n_heads/tp heads, k/v: n_kv_heads/tp)
//   o_proj, down_proj                            row-parallel: input columns split
//   embed_tokens, lm_head                        vocabulary-parallel: rows split, the
//                                                vocabulary padded to a multiple of tp
//   the RMSNorm weights                          replicated (the q/k norms too: each
//                                                rank's heads add to their gradients)
class TensorParallelStyle : public ParallelStyle, public ExpertWidthSplit {
 public:
  // tp: the tp group's communicator (not owned). Throws anvil::Error when tp
  // does not divide the heads or the feed-forward width.
  TensorParallelStyle(Communicator& tp, const ModelArgs& args, TensorParallelOptions options);
  int rank() const { return comm_.rank(); }
  int size() const { return comm_.size(); }
  bool sequence_parallel() const { return options_.sequence_parallel; }
  bool loss_parallel() const { return options_.loss_parallel; }

  std::vector<ParamSpec> shard_params(std::vector<ParamSpec> global) const override;
  int64_t residual_rows(int64_t M) const override;
  Tensor embedding_forward(const Tensor& tokens, const Tensor& weight, DType dt) const override;
  void embedding_backward(const Tensor& dh, const Tensor& tokens, Tensor grad) const override;
  Tensor gather_rows(const Tensor& local, const char* tag) const override;
  Tensor row_parallel_out(const Tensor& residual, const Tensor& in, const Tensor& w, const char* tag) const override;
  Tensor column_input_grad(std::initializer_list<InputGradTerm> terms, DType dt, const char* tag) const override;
  NormGradTargets norm_grad_targets(std::initializer_list<Tensor> grads, NormRows rows) const override;
  void finish_norm_grads(const NormGradTargets& targets, std::initializer_list<Tensor> grads) const override;
  CrossEntropyResult loss_forward_backward(const Tensor& hn, const Tensor& w, Tensor dw, const Tensor& targets,
                                           float grad_scale, Tensor& dhn) const override;
  CrossEntropyResult loss_forward(const Tensor& hn, const Tensor& w, const Tensor& targets) const override;
  // A mixture of experts: each rank holds every expert's F/tp slice (shard_params splits the experts'
  // gate, up and down projections as the dense ones), its output reduced as a row-parallel product's.
  const ExpertWidthSplit* expert_width_split() const override { return this; }
  Tensor reduce_partial_out(const Tensor& residual, const Tensor& partial, const char* tag) const override;
  Tensor reduce_partial_grad(const Tensor& partial, DType dt, const char* tag) const override;
  bool first_rank() const override { return rank() == 0; }
  void sum_over_ranks(const Tensor& t) const override { all_reduce_sum(t); }

 private:
  // Collectives over the tp group, traced while profiling. f32 or bf16 (bf16
  // sums accumulate in fp32 and round once).
  void all_reduce_sum(const Tensor& t) const;
  void all_reduce_max(const Tensor& t) const;
  void all_gather(const Tensor& shard, const Tensor& full) const;     // full (tp·k, ...) ← shards (k, ...)
  void reduce_scatter(const Tensor& full, const Tensor& shard) const;  // shard ← Σ_ranks full's rows of this rank
  // Partial sums (M, D) f32 on every rank, reduced over tp (reduce-scattered to
  // this rank's rows under sequence parallelism) and rounded once to dt.
  Tensor reduce_partial(const Tensor& partial, DType dt, const char* tag) const;
  // An f32 (M, D) buffer holding the residual's share of a reduced output:
  // this rank's rows of it (sequence parallel) or all of it on rank 0, zeros elsewhere.
  Tensor partial_with_residual(const Tensor& residual, int64_t M, const char* tag) const;
  // Where this rank's shard of a vocabulary-parallel weight (its local tensor,
  // padding included) begins, and how many of its rows are real (unpadded).
  int64_t vocab_begin(const Tensor& local) const { return rank() * local.size(0); }
  int64_t vocab_rows(const Tensor& local) const;
  // Loss parallel's statistics combined over tp: each row's log-sum-exp over
  // the whole vocabulary. w: the real rows of the shard, which begins at `begin`.
  CrossEntropyResult loss_parallel_lse(const Tensor& hn, const Tensor& w, int64_t begin, const Tensor& targets,
                                       Tensor& lse) const;
  Tensor gather_output_weight(const Tensor& local) const;  // (V_p, D), the padded vocabulary

  Communicator& comm_;
  ModelArgs args_;
  TensorParallelOptions options_;
};

// A padded vocabulary: the smallest multiple of tp holding vocab_size, so every
// rank's embedding and output shard has the same number of rows (collectives
// and FSDP's flat shards need equal pieces). The padding rows are zero, receive
// no gradient (no token id reaches them, and the loss kernels are given only
// the real rows) and are dropped from checkpoints.
int64_t padded_vocab_size(int64_t vocab_size, int tp);

// Tensor-parallel rank `rank`'s parameters of `tp`, from the global list:
// column-parallel weights split by rows, row-parallel ones by columns, the
// embedding and output head by (padded) vocabulary rows, the norms replicated.
std::vector<ParamSpec> tensor_parallel_param_specs(std::vector<ParamSpec> specs, int tp, int rank);

// For tensor parallelism's checkpoints, which hold global tensors by name.
// local (spec.shape) ← this rank's slice of global (spec.global_shape()); padding zeroed.
void copy_global_to_local(const ParamSpec& spec, const Tensor& global, const Tensor& local);
// global (spec.global_shape()) ← the tp ranks' local tensors stacked in rank
// order, stacked (tp, spec.numel()); `spec` is any rank's spec of the
// parameter (the ranks' slices differ only in where they begin).
void assemble_global(const ParamSpec& spec, int tp, const Tensor& stacked, const Tensor& global);

// A rank's local flat buffer (laid out as ParamStore lays out local_specs)
// filled from a global one, parameter by parameter, by name: local_specs may
// be any subset of global_specs (a pipeline stage's), sliced or whole.
void global_flat_to_local(const std::vector<ParamSpec>& global_specs, const Tensor& global_flat,
                          const std::vector<ParamSpec>& local_specs, const Tensor& local_flat);

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
