// AdamW (Loshchilov & Hutter, "Decoupled Weight Decay Regularization"), with
// the same update as torch.optim.AdamW. For step t = 1, 2, ...:
//   p ← p − lr·wd·p                      (decay decoupled from the gradient)
//   m ← β1·m + (1 − β1)·g
//   v ← β2·v + (1 − β2)·g²
//   m̂ = m / (1 − β1^t),  v̂ = v / (1 − β2^t)
//   p ← p − lr·m̂ / (sqrt(v̂) + eps)
// Memory-bound, so everything happens in one fused pass: each element of p, g,
// m, v is read once and p, m, v written once, in f32 registers.
//
// Mixed precision keeps fp32 master weights and a bf16 copy of them for the
// forward/backward matrix products; that copy can be written in the same pass.
// Gradient clipping needs no pass of its own either: the clip coefficient
// (see grad_norm.h) is passed as grad_scale and applied to g on the fly.
#pragma once
#include <cstdint>

#include "anvil/core/tensor.h"

namespace anvil {

struct AdamWConfig {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.01f;
};

// Throws anvil::Error for hyper-parameters outside their valid ranges
// (lr ≥ 0, 0 ≤ β < 1, eps > 0, weight_decay ≥ 0, all finite).
void check_adamw_config(const AdamWConfig& cfg);

// One step's constants, worked out once on the host (in double where powers
// are involved) so the inner loop is only multiplies, FMAs, one sqrt and one
// divide: the CPU kernel and its CUDA twin (ops/cuda/adamw_body.h) use these.
struct AdamWCoeffs {
  float decay;  // 1 − lr·wd
  float beta1, one_minus_beta1;
  float beta2, one_minus_beta2;
  float step_size;     // lr / (1 − β1^t)
  float inv_sqrt_bc2;  // 1 / sqrt(1 − β2^t)
  float eps;
  float grad_scale;
};
AdamWCoeffs adamw_coeffs(const AdamWConfig& cfg, int64_t step, float grad_scale);

// One AdamW step for one parameter tensor; any shape, all with the same numel n.
// cfg         hyper-parameters (lr is the learning rate of this step, after any schedule)
// step        t, counted from 1 (the bias corrections use it); throws anvil::Error if t < 1
// p    (n)    f32 master parameters, updated in place
// g    (n)    f32 gradient, read only; used as grad_scale·g
// m    (n)    f32 first moment, updated in place (zero before step 1)
// v    (n)    f32 second moment, updated in place (zero before step 1)
// p_bf16 (n)  optional bf16 compute copy, overwritten with bf16(p) after the update
//             (rounded to nearest even); nullptr to skip
// grad_scale  multiplies the gradient as it is read, e.g. the clip coefficient
void adamw_step(const AdamWConfig& cfg, int64_t step, Tensor& p, const Tensor& g, Tensor& m, Tensor& v,
                Tensor* p_bf16 = nullptr, float grad_scale = 1.0f);

}  // namespace anvil
