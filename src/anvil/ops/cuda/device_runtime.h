// The CUDA backend's side of core/device.h: how core moves, zeroes and
// converts bytes on a GPU, all on one stream, and where a GPU's pool maps its
// memory from (cuda/device_memory.h). `anvil` registers it at start-up; a
// binary without the CUDA backend has no runtime and says so when asked for a GPU.
#pragma once
#include <cuda_runtime_api.h>

namespace anvil {

// Registers the CUDA runtime with core (once; later calls do nothing). Needs
// no GPU: a GPU is first touched when a tensor is made on one.
void register_cuda_runtime();
// Registers the ops' GPU kernels (ops/gpu_kernels.h; once). register_cuda_runtime
// calls it: a binary with a GPU runtime has its kernels.
void register_cuda_kernels();

// The one stream every kernel, library call and copy of a training step is
// ordered on (created on first use). One stream keeps the step's order the
// program's order: nothing inside a step waits for the host but the reads of
// the loss and the gradient norm.
cudaStream_t cuda_stream();

}  // namespace anvil
