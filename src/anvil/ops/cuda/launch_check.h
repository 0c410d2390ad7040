// The check after every kernel launch in ops/cuda/*.cu.
#pragma once
#include <cuda_runtime_api.h>

#include "anvil/core/error.h"

namespace anvil {

// Throws anvil::Error naming the kernel if its launch failed (a bad launch
// shape, no device, a sticky error from earlier work on the device).
inline void check_launch(const char* kernel) {
  const cudaError_t err = cudaGetLastError();
  ANVIL_CHECK(err == cudaSuccess, kernel, ": launch failed: ", cudaGetErrorString(err));
}

}  // namespace anvil
