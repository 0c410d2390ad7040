// What the CUDA tests share.
#pragma once
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "anvil/cuda/device.h"

// Skips the calling test, with the runtime's reason, where no GPU is present.
#define SKIP_WITHOUT_GPU()                                                                  \
  do {                                                                                      \
    std::string why;                                                                        \
    if (anvil::cuda_devices(&why).empty()) GTEST_SKIP() << "no CUDA GPU (" << why << ")"; \
  } while (0)

namespace anvil::testing {

// A device copy of a host array, freed with it; transfer errors throw (a test
// fails on an uncaught exception, naming it).
template <class T>
class DeviceArray {
 public:
  explicit DeviceArray(const std::vector<T>& host) : n_(host.size()) {
    check(cudaMalloc(&ptr_, bytes()), "cudaMalloc");
    upload(host);
  }
  ~DeviceArray() { cudaFree(ptr_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;

  T* get() const { return static_cast<T*>(ptr_); }
  // Overwrites the device copy with `host` (of the same size).
  void upload(const std::vector<T>& host) const {
    if (host.size() != n_) throw std::runtime_error("DeviceArray::upload: size mismatch");
    check(cudaMemcpy(ptr_, host.data(), bytes(), cudaMemcpyHostToDevice), "cudaMemcpy to the GPU");
  }
  // Waits for the device's work, then copies back.
  std::vector<T> download() const {
    check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    std::vector<T> host(n_);
    check(cudaMemcpy(host.data(), ptr_, bytes(), cudaMemcpyDeviceToHost), "cudaMemcpy from the GPU");
    return host;
  }

 private:
  static void check(cudaError_t e, const char* what) {
    if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
  }
  size_t bytes() const { return n_ * sizeof(T); }
  size_t n_;
  void* ptr_ = nullptr;
};

}  // namespace anvil::testing
