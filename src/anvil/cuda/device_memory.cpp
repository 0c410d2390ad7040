#include "anvil/cuda/device_memory.h"

#include <cuda_runtime_api.h>

#include "anvil/core/error.h"
#include "anvil/cuda/device.h"

namespace anvil {

CudaDeviceMemory::CudaDeviceMemory(int device) : device_(device) {
  std::string why;
  const std::vector<CudaDeviceInfo> gpus = cuda_devices(&why);
  ANVIL_CHECK(device >= 0 && device < static_cast<int>(gpus.size()), "CUDA device ", device, " is not there (",
              gpus.empty() ? why : detail::concat(gpus.size(), " visible"), ")");
  name_ = detail::concat("cuda:", device, " (", gpus[static_cast<size_t>(device)].name, ")");
}

void* CudaDeviceMemory::map(size_t bytes) {
  cudaError_t e = cudaSetDevice(device_);
  ANVIL_CHECK(e == cudaSuccess, "cudaSetDevice(", device_, "): ", cudaGetErrorString(e));
  void* p = nullptr;
  e = cudaMalloc(&p, bytes);
  if (e == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();  // not sticky: the pool returns its cache and tries again
    return nullptr;
  }
  ANVIL_CHECK(e == cudaSuccess, "cudaMalloc(", bytes, ") on ", name_, ": ", cudaGetErrorString(e));
  return p;
}

void CudaDeviceMemory::unmap(void* ptr, size_t) {
  const cudaError_t e = cudaFree(ptr);
  ANVIL_CHECK(e == cudaSuccess, "cudaFree on ", name_, ": ", cudaGetErrorString(e));
}

std::string CudaDeviceMemory::name() const { return name_; }

}  // namespace anvil
