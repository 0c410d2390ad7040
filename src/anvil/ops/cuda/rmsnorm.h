// RMSNorm on the GPU, the CUDA twins of ops/rmsnorm.h over device pointers:
// x, y, dy, dx (M, D) and w (D) of one storage type, f32 (float) or bf16
// (uint16_t bits); rstd (M) f32. Launch on `stream` and return at once; a
// launch error throws anvil::Error.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace anvil {

// y = x·rsqrt(mean(x²) + eps)·w per row; rstd[m] = that rsqrt when rstd is
// not null (the backward needs it). y may be x.
template <class T>
void rmsnorm_forward_cuda(const T* x, const T* w, float eps, T* y, float* rstd, int64_t M, int64_t D,
                          cudaStream_t stream);

// Floats of device scratch rmsnorm_backward_cuda needs for M rows of D: one
// f32 dw partial per split of rows.
int64_t rmsnorm_backward_scratch(int64_t M, int64_t D);

// dx = r·dy·w − (r³/D)·(Σ dy·w·x)·x per row, written, or added to dx when
// accumulate_dx; dw (D), f32 or bf16, ACCUMULATED: dw += Σ_rows dy·x·r,
// summed in an order fixed by M alone (the same bits on every run). rstd is
// the forward's (required). scratch holds rmsnorm_backward_scratch(M, D)
// floats. dx may be dy.
template <class T, class G>
void rmsnorm_backward_cuda(const T* dy, const T* x, const T* w, const float* rstd, T* dx, G* dw, float* scratch,
                           int64_t M, int64_t D, bool accumulate_dx, cudaStream_t stream);

}  // namespace anvil
