// Global gradient norm and clipping, as torch.nn.utils.clip_grad_norm_ (L2 norm).
//
// The norm is split into steps so a distributed trainer can all-reduce in the
// middle and fold the clipping into the optimizer instead of a separate pass:
//   double ss   = grad_sum_of_squares(local_grads);      // this rank's partial sum
//   /* all-reduce ss (sum) across ranks */
//   double norm = grad_norm_from_sum_of_squares(ss);
//   if (!std::isfinite(norm)) stop;                      // NaN/Inf gradients
//   float coef  = clip_coefficient(norm, max_norm);      // ≤ 1
//   adamw_step(..., /*grad_scale=*/coef);                // clipping applied on the fly
// clip_grad_norm_ does it all in place for the single-process case.
//
// NaN or Inf anywhere in the gradients gives a NaN/Inf norm: nothing hides it.
#pragma once
#include <cmath>
#include <span>

#include "anvil/core/tensor.h"

namespace anvil {

// Σ x² over every element of every tensor, accumulated in double (per thread,
// then summed in a fixed order, so the result is reproducible for a given
// thread count). Tensors are f32 or bf16, any shapes, mixed dtypes allowed.
double grad_sum_of_squares(std::span<const Tensor> grads);

// The global L2 norm from a (fully reduced) sum of squares.
inline double grad_norm_from_sum_of_squares(double sum_of_squares) { return std::sqrt(sum_of_squares); }

// min(1, max_norm / (total_norm + 1e-6)), as torch.nn.utils.clip_grad_norm_;
// the 1e-6 keeps the division finite for a zero norm. A non-finite total_norm
// gives NaN, so a caller that uses the coefficient anyway cannot silently train
// on a broken step. Throws anvil::Error unless max_norm is finite and > 0.
double clip_coefficient(double total_norm, double max_norm);

// x ← scale·x for every element of every tensor (bf16 rounded to nearest even).
// The tensors' contents are modified (Tensor is a handle to shared storage).
void scale_grads_(std::span<const Tensor> grads, float scale);

// Computes the global norm and, when it exceeds max_norm, scales all gradients
// in place by clip_coefficient. Returns the norm before clipping. A non-finite
// norm is returned as is and the gradients are left untouched for inspection.
double clip_grad_norm_(std::span<const Tensor> grads, double max_norm);

}  // namespace anvil
