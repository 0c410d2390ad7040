// A GPU's memory as the device pool (core/device_pool.h) maps it: cudaMalloc
// for a segment, cudaFree to return it. Built only with the CUDA backend.
#pragma once
#include <string>

#include "anvil/core/device_pool.h"

namespace anvil {

class CudaDeviceMemory : public DeviceMemory {
 public:
  // GPU `device` (an index among the visible ones); throws anvil::Error when there is none.
  explicit CudaDeviceMemory(int device);
  // Null when the GPU has no room (cudaErrorMemoryAllocation, the error cleared); other errors throw.
  void* map(size_t bytes) override;
  void unmap(void* ptr, size_t bytes) override;
  std::string name() const override;

 private:
  int device_;
  std::string name_;
};

}  // namespace anvil
