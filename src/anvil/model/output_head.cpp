#include "anvil/model/output_head.h"

#include "anvil/ops/matmul.h"
#include "anvil/ops/rmsnorm.h"

namespace anvil {

CrossEntropyResult OutputHead::forward_backward(const Tensor& h, const Tensor& targets, float grad_scale,
                                                Tensor& dh) {
  const DType dt = params_.compute_dtype();
  const int64_t Ml = h.size(0), D = h.size(1);
  const Tensor norm_w = params_.compute(norm_);
  dh = new_activation({Ml, D}, dt, "grad.residual");
  Tensor hn = new_activation({Ml, D}, dt, "final_norm.out");
  Tensor rstd = new_activation({Ml}, DType::f32, "final_norm.rstd");
  rmsnorm_forward(h, norm_w, eps_, hn, rstd);
  hn = style_.gather_rows(hn, "final_norm.out");  // the output projection sees every row
  Tensor dhn;                                    // (residual_rows(M), D)
  const CrossEntropyResult loss =
      style_.loss_forward_backward(hn, params_.compute(output_), params_.grad(output_), targets, grad_scale, dhn);
  hn = Tensor();
  const NormGradTargets norm_grad = style_.norm_grad_targets({params_.grad(norm_)});
  Tensor g_norm = norm_grad.at[0];
  rmsnorm_backward(dhn, h, norm_w, rstd, eps_, dh, g_norm);
  style_.finish_norm_grads(norm_grad, {params_.grad(norm_)});
  return loss;
}

Tensor OutputHead::logits(const Tensor& h) const {
  const DType dt = params_.compute_dtype();
  Tensor hn = new_activation(h.shape(), dt, "final_norm.out");
  rmsnorm_forward(h, params_.compute(norm_), eps_, hn);
  hn = style_.gather_rows(hn, "final_norm.out");
  const Tensor w = params_.compute(output_);
  Tensor out = new_activation({hn.size(0), w.size(0)}, dt, "head.logits");
  linear_forward(hn, w, out);
  return out;
}

CrossEntropyResult OutputHead::forward(const Tensor& h, const Tensor& targets) const {
  Tensor hn = new_activation(h.shape(), params_.compute_dtype(), "final_norm.out");
  rmsnorm_forward(h, params_.compute(norm_), eps_, hn);
  hn = style_.gather_rows(hn, "final_norm.out");
  return style_.loss_forward(hn, params_.compute(output_), targets);
}

}  // namespace anvil
