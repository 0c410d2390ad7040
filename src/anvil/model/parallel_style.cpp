#include "anvil/model/parallel_style.h"

#include "anvil/core/error.h"
#include "anvil/ops/attention.h"
#include "anvil/ops/embedding.h"
#include "anvil/ops/matmul.h"

namespace anvil {

Tensor ParallelStyle::embedding_forward(const Tensor& tokens, const Tensor& weight, DType dt) const {
  Tensor h = new_activation({tokens.numel(), weight.size(1)}, dt, "embed.out");
  anvil::embedding_forward(tokens, weight, h);
  return h;
}

void ParallelStyle::embedding_backward(const Tensor& dh, const Tensor& tokens, Tensor grad) const {
  anvil::embedding_backward(dh, tokens, grad);
}

Tensor ParallelStyle::row_parallel_out(const Tensor& residual, const Tensor& in, const Tensor& w,
                                       const char* tag) const {
  Tensor out = new_activation(residual.shape(), residual.dtype(), tag);
  out.copy_from(residual);
  linear_forward_accumulate(in, w, out);  // out (M, D) += in (M, K) · w (D, K)ᵀ
  return out;
}

Tensor ParallelStyle::reduce_partial_out(const Tensor& residual, const Tensor& partial, const char* tag) const {
  ANVIL_ASSERT(false, tag, ": a partial output under a style that splits no expert (expert_width_split() is null)");
  return residual;
}

Tensor ParallelStyle::column_input_grad(std::initializer_list<InputGradTerm> terms, DType dt, const char* tag) const {
  const InputGradTerm& first = *terms.begin();
  Tensor dx = new_activation({first.dy.size(0), first.w.size(1)}, dt, tag);
  bool accumulate = false;
  for (const InputGradTerm& t : terms) {
    linear_backward_input(t.dy, t.w, dx, accumulate);
    accumulate = true;
  }
  return dx;
}

CrossEntropyResult ParallelStyle::loss_forward_backward(const Tensor& hn, const Tensor& w, Tensor dw,
                                                        const Tensor& targets, float grad_scale, Tensor& dhn) const {
  dhn = new_activation(hn.shape(), hn.dtype(), "final_norm.dout");
  return cross_entropy_forward_backward(hn, w, targets, grad_scale, dhn, dw);
}

CrossEntropyResult ParallelStyle::loss_forward(const Tensor& hn, const Tensor& w, const Tensor& targets) const {
  return cross_entropy_forward(hn, w, targets);
}

void ParallelStyle::rope_forward(const Tensor& x, const RopeTable& table, Tensor& y) const {
  if (sequence_) return sequence_->rope_forward(x, table, y);
  anvil::rope_forward(x, table, 0, y);
}

void ParallelStyle::rope_backward(const Tensor& dy, const RopeTable& table, Tensor& dx) const {
  if (sequence_) return sequence_->rope_backward(dy, table, dx);
  anvil::rope_backward(dy, table, 0, dx);
}

void ParallelStyle::attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                                      const Tensor& documents) const {
  if (sequence_) return sequence_->attention_forward(q, k, v, out, lse, documents);
  anvil::attention_forward(q, k, v, out, lse, 0.0f, {}, AttentionWindow{0, 0, documents});
}

void ParallelStyle::attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                                       const Tensor& out, const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv,
                                       const Tensor& documents) const {
  if (sequence_) return sequence_->attention_backward(dout, q, k, v, out, lse, dq, dk, dv, documents);
  anvil::attention_backward(dout, q, k, v, out, lse, dq, dk, dv, 0.0f, {}, AttentionWindow{0, 0, documents});
}

}  // namespace anvil
