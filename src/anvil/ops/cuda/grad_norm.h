// Gradient norm and clipping on the GPU, the CUDA twins of ops/grad_norm.h,
// over one flat gradient buffer (f32, or bf16 as uint16_t bits). The steps are
// those of the CPU op: the sum of squares stays on the device (a trainer may
// all-reduce it there), the caller copies it back to take the norm, check it
// and work out clip_coefficient, and the coefficient goes to adamw_step_cuda as
// grad_scale or to scale_grads_cuda.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace anvil {

// Doubles of device workspace grad_sum_of_squares_cuda needs (one per block).
int64_t grad_sum_of_squares_workspace();

// *out = Σ x² over the n elements of x, in double (device pointers; workspace
// holds grad_sum_of_squares_workspace() doubles). The result does not depend
// on anything but n and the values. Launches on `stream` and returns at once;
// a launch error throws anvil::Error.
void grad_sum_of_squares_cuda(const float* x, int64_t n, double* workspace, double* out, cudaStream_t stream);
void grad_sum_of_squares_cuda(const uint16_t* x, int64_t n, double* workspace, double* out, cudaStream_t stream);

// x ← scale·x, bf16 rounded to nearest even: scale_grads_'s bits.
void scale_grads_cuda(float* x, int64_t n, float scale, cudaStream_t stream);
void scale_grads_cuda(uint16_t* x, int64_t n, float scale, cudaStream_t stream);

}  // namespace anvil
