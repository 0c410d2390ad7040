// The parallel style: the places in the modules' dataflow where a parallelism
// applied from outside acts (PyTorch's ParallelStyle — colwise, rowwise,
// sequence and loss parallel — which torchtitan's parallelize plans pick per
// module): which part of each parameter
// this rank holds, and what happens at each seam between kernels. The base
// class is the single process: every seam is the plain computation, and the
// modules call nothing else, so the model has one code path and no
// parallelism in it. Tensor parallelism (distributed/tensor_parallel.h) overrides
// the seams with Megatron's column-, row- and vocabulary-parallel products,
// sequence parallelism and loss parallelism.
//
// Names of the seams follow the products they sit around: a column-parallel
// product (q/k/v, gate/up, the output head) reads the whole input and writes
// a slice of its output; a row-parallel one (o, down) reads a slice and writes
// partial sums of the whole output.
#pragma once
#include <initializer_list>
#include <vector>

#include "anvil/core/tensor.h"
#include "anvil/model/params.h"
#include "anvil/ops/cross_entropy.h"
#include "anvil/ops/rope.h"

namespace anvil {

class ExpertWidthSplit;  // model/moe_feed_forward.h

// An activation (or activation gradient) of the model, tagged for the allocator.
inline Tensor new_activation(Shape shape, DType dt, const char* tag) {
  return Tensor::empty(std::move(shape), dt, MemCategory::activations, tag);
}

// One term dy·w of an input gradient.
struct InputGradTerm {
  Tensor dy, w;
};

// Where a backward's RMSNorm weight gradients accumulate: `at[i]` for the i-th
// gradient given; `scratch` is the style's, if it needs one.
struct NormGradTargets {
  std::vector<Tensor> at;
  Tensor scratch;
};

// Where a rank's token rows sit in their sequences, for the places that care:
// RoPE, attention and a mixture of experts' per-sequence statistics. Without
// one, each row of a micro-batch is a whole sequence from position 0. Context
// parallelism (distributed/context_parallel.h) holds chunks of sequences
// instead and runs attention across its group.
class SequenceLayout {
 public:
  virtual ~SequenceLayout() = default;
  // A block's B rows of T tokens hold parts of sequences(B) sequences; local
  // sequence b's tokens are the runs (first token, tokens) among the B·T, and
  // token i sits at positions[i] of its sequence. sum_over_parts adds values
  // (the same layout on every rank) over the ranks holding the other parts of
  // the same sequences, in place.
  struct TokenRun {
    int64_t first, tokens;
  };
  virtual int64_t sequences(int64_t B) const = 0;
  virtual std::vector<TokenRun> sequence_runs(int64_t b, int64_t B, int64_t T) const = 0;
  virtual std::vector<int64_t> token_positions(int64_t B, int64_t T) const = 0;
  virtual void sum_over_parts(std::vector<double>& values) const = 0;
  // x, y (B, T, H, D): RoPE at the rows' positions (y may be x).
  virtual void rope_forward(const Tensor& x, const RopeTable& table, Tensor& y) const = 0;
  virtual void rope_backward(const Tensor& dy, const RopeTable& table, Tensor& dx) const = 0;
  // Causal attention of the rows (ops/attention.h's shapes), block-causal
  // within the documents of the whole sequences when `documents` (B, 2, T)
  // is defined (AttentionWindow::documents).
  virtual void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                                 const Tensor& documents) const = 0;
  virtual void attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                  const Tensor& out, const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv,
                                  const Tensor& documents) const = 0;
};

class ParallelStyle {
 public:
  virtual ~ParallelStyle() = default;

  // RoPE and attention through the sequence layout, if one is set (it must
  // outlive this style), else over whole sequences.
  void set_sequence_layout(const SequenceLayout* layout) { sequence_ = layout; }
  const SequenceLayout* sequence_layout() const { return sequence_; }
  void rope_forward(const Tensor& x, const RopeTable& table, Tensor& y) const;
  void rope_backward(const Tensor& dy, const RopeTable& table, Tensor& dx) const;
  // documents: as SequenceLayout's; undefined: causal.
  void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                         const Tensor& documents = {}) const;
  void attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                          const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv, const Tensor& documents = {}) const;

  // This rank's parameters, from the model's whole list (in the same order,
  // each spec's `slice` saying where its tensor sits in the global one).
  virtual std::vector<ParamSpec> shard_params(std::vector<ParamSpec> global) const { return global; }

  // Rows of the residual stream this rank holds of a micro-batch's M token rows.
  virtual int64_t residual_rows(int64_t M) const { return M; }

  // Token embedding: (residual_rows(M), D) in dt ← weight's rows of tokens (M);
  // backward adds dh's rows into grad's rows of the tokens.
  virtual Tensor embedding_forward(const Tensor& tokens, const Tensor& weight, DType dt) const;
  virtual void embedding_backward(const Tensor& dh, const Tensor& tokens, Tensor grad) const;

  // Before column-parallel products: all M rows of a (residual_rows(M), ·)
  // tensor (a norm's output, or an output gradient). Returns `local` itself
  // when this rank holds every row.
  virtual Tensor gather_rows(const Tensor& local, const char* tag) const { return local; }

  // residual + in·wᵀ, the row-parallel product with the residual add folded
  // in: (residual_rows(M), D) in residual's dtype.
  virtual Tensor row_parallel_out(const Tensor& residual, const Tensor& in, const Tensor& w, const char* tag) const;

  // Σ dy·w over the terms: the input gradient (residual_rows(M), D) in dt of
  // column-parallel products that share their input.
  virtual Tensor column_input_grad(std::initializer_list<InputGradTerm> terms, DType dt, const char* tag) const;

  // A mixture of experts' layer: whether this style splits every expert's
  // width over its ranks (null: each rank runs whole experts), and, when it
  // does, the seams of the layer's partial output and input gradient (M, D),
  // reduced to (residual_rows(M), D) in dt, the output with the residual added.
  virtual const ExpertWidthSplit* expert_width_split() const { return nullptr; }
  virtual Tensor reduce_partial_out(const Tensor& residual, const Tensor& partial, const char* tag) const;
  virtual Tensor reduce_partial_grad(const Tensor& partial, DType dt, const char* tag) const { return partial; }

  // RMSNorm weight gradients in a backward: norm_grad_targets(grads) says where
  // the norm backwards accumulate them (the gradients themselves here), and
  // finish_norm_grads(targets, grads) completes them after the last one.
  // rows: what the norms run over, the residual stream's rows or this rank's
  // heads (Qwen3's q/k norms; a tensor-parallel rank holds a share of them).
  enum class NormRows { residual, heads };
  virtual NormGradTargets norm_grad_targets(std::initializer_list<Tensor> grads,
                                            NormRows rows = NormRows::residual) const {
    return {grads, Tensor()};
  }
  virtual void finish_norm_grads(const NormGradTargets& targets, std::initializer_list<Tensor> grads) const {}

  // The output head over this rank's output weight w (with gradient dw):
  // logits, cross-entropy and, for training, both gradients of
  // grad_scale · loss_sum, fused so the logits are never whole. hn has all M
  // rows; dhn gets (residual_rows(M), D) in hn's dtype.
  virtual CrossEntropyResult loss_forward_backward(const Tensor& hn, const Tensor& w, Tensor dw, const Tensor& targets,
                                                   float grad_scale, Tensor& dhn) const;
  virtual CrossEntropyResult loss_forward(const Tensor& hn, const Tensor& w, const Tensor& targets) const;

 private:
  const SequenceLayout* sequence_ = nullptr;
};

}  // namespace anvil
