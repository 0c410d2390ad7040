// AdamW's per-element body (kernel_body.h), the CUDA twin of ops/adamw.cpp.
//
// The arithmetic is the CPU kernel's, operation for operation, with the same
// roundings (both its paths write these FMAs explicitly), and the constants
// are its own (adamw_coeffs, ops/adamw.h):
//   g' = g·grad_scale
//   m  = fma(m, β1, g'·(1 − β1))
//   v  = fma(v, β2, (g'·g')·(1 − β2))
//   d  = fma(sqrt(v), 1/sqrt(1 − β2^t), eps)
//   p  = fma(−step_size, m/d, p·(1 − lr·wd))
// Every FMA is written as fma_rn and every other operation as a rounded _rn
// operation, and no product feeds an addition, so neither nvcc (which would
// contract a*b + c where it chose to) nor g++ can round differently: host and
// device give the CPU op's bits. Hence no -fmad=false for this file.
#pragma once
#include <cmath>
#include <cstdint>

#include "anvil/ops/adamw.h"
#include "anvil/ops/cuda/kernel_body.h"

namespace anvil::kernel {

constexpr unsigned kAdamWThreads = 256;

inline LaunchShape adamw_launch_shape(int64_t n) { return {{blocks_for(n, kAdamWThreads), 1}, {kAdamWThreads, 1}}; }

// One thread's share of the update (grid-stride); p_bf16 may be null.
ANVIL_HD inline void adamw_body(const ThreadPos& pos, const AdamWCoeffs& c, float* p, const float* g, float* m,
                                float* v, uint16_t* p_bf16, int64_t n) {
  for (int64_t i = pos.global_x(); i < n; i += pos.grid_stride_x()) {
    const float gi = mul_rn(g[i], c.grad_scale);
    const float mi = fma_rn(m[i], c.beta1, mul_rn(gi, c.one_minus_beta1));
    const float vi = fma_rn(v[i], c.beta2, mul_rn(mul_rn(gi, gi), c.one_minus_beta2));
    const float denom = fma_rn(sqrt_rn(vi), c.inv_sqrt_bc2, c.eps);
    const float pi = fma_rn(-c.step_size, div_rn(mi, denom), mul_rn(p[i], c.decay));
    m[i] = mi, v[i] = vi, p[i] = pi;
    if (p_bf16) p_bf16[i] = bf16_from_f32(pi);
  }
}

}  // namespace anvil::kernel
