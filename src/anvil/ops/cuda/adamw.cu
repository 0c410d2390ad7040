#include <cmath>

#include "anvil/core/error.h"
#include "anvil/ops/cuda/adamw.h"
#include "anvil/ops/cuda/adamw_body.h"
#include "anvil/ops/cuda/launch_check.h"

namespace anvil {

namespace {

__global__ void adamw_kernel(AdamWCoeffs c, float* __restrict__ p, const float* __restrict__ g,
                             float* __restrict__ m, float* __restrict__ v, uint16_t* __restrict__ p_bf16, int64_t n) {
  kernel::adamw_body(kernel::this_thread(), c, p, g, m, v, p_bf16, n);
}

}  // namespace

void adamw_step_cuda(const AdamWConfig& cfg, int64_t step, float* p, const float* g, float* m, float* v,
                     uint16_t* p_bf16, int64_t n, float grad_scale, cudaStream_t stream) {
  ANVIL_CHECK(step >= 1, "AdamW: step = ", step, " is invalid; steps are counted from 1 (the bias correction ",
              "divides by 1 - beta^step). Pass the number of this optimizer step, starting at 1.");
  ANVIL_CHECK(std::isfinite(grad_scale), "AdamW: grad_scale = ", grad_scale,
              " is not finite (a NaN/Inf gradient norm?). Stop or skip the step instead of updating the weights.");
  if (n <= 0) return;
  const kernel::LaunchShape s = kernel::adamw_launch_shape(n);
  adamw_kernel<<<s.grid.x, s.block.x, 0, stream>>>(adamw_coeffs(cfg, step, grad_scale), p, g, m, v, p_bf16, n);
  check_launch("adamw_step_cuda");
}

}  // namespace anvil
