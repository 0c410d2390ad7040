// RMSNorm as in Llama: y = x · rsqrt(mean(x²) + eps) · w, over the last dim.
// No mean subtraction and no bias (Zhang & Sennrich 2019). f32 or bf16 storage,
// f32 arithmetic inside; one pass over memory per row (the row stays in L1
// between the reduction and the scaling).
#pragma once
#include "anvil/core/tensor.h"

namespace anvil {

// x    (M, D)  activations, f32 or bf16 (any leading shape; M = numel / D)
// w    (D)     gain, the compute copy: same dtype as x
// y    (M, D)  output, same dtype and shape as x (written)
// rstd (M)     f32, rsqrt(mean(x²) + eps) per row, saved for the backward.
//              Optional: pass an undefined Tensor() to skip saving it, and the
//              backward recomputes it from x. (Tensor is a handle: the const is
//              on the handle, the values are written.)
void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, Tensor& y, const Tensor& rstd = Tensor());

// dy   (M, D)  gradient of y, same dtype as x
// x    (M, D)  the forward's input
// w    (D)     the forward's gain, same dtype as x
// rstd (M)     f32 from the forward, or undefined: then recomputed from x and eps
// dx   (M, D)  same dtype as x: written, or added to when accumulate_dx (the
//              residual stream's gradient, saving a separate add pass)
// dw   (D)     f32 or bf16: ACCUMULATED, dw += Σ_rows dy·x·rstd. The rows are
//              reduced in fixed chunks (per-chunk partial sums, then a sum over
//              chunks), so the result does not depend on the thread count.
void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd, float eps, Tensor& dx,
                      Tensor& dw, bool accumulate_dx = false);

}  // namespace anvil
