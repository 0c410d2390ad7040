// SwiGLU on the GPU, the CUDA twins of ops/swiglu.h over device pointers of n
// elements each, f32 (float) or bf16 (uint16_t bits), all of one call alike.
// In-place use as the CPU op allows (h may be g or u; dg and du may each be
// dh, g or u, but not each other). Launch on `stream` and return at once; a
// launch error throws anvil::Error.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace anvil {

// h = silu(g)·u
template <class T>
void swiglu_forward_cuda(const T* g, const T* u, T* h, int64_t n, cudaStream_t stream);

// dg = dh·u·silu'(g), du = dh·silu(g)
template <class T>
void swiglu_backward_cuda(const T* dh, const T* g, const T* u, T* dg, T* du, int64_t n, cudaStream_t stream);

}  // namespace anvil
