// The device pool on a real GPU (core/device_pool.h over cuda/device_memory.h):
// what the pool says it reserved is what the GPU lost (cudaMemGetInfo), the
// memory is usable, and a request larger than the GPU is refused by name.
// Skips with one line where no GPU is present.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "anvil/core/device_pool.h"
#include "anvil/cuda/device.h"
#include "cuda_test_util.h"
#include "anvil/cuda/device_memory.h"

namespace {

size_t free_bytes() {
  size_t free = 0, total = 0;
  EXPECT_EQ(cudaMemGetInfo(&free, &total), cudaSuccess);
  return free;
}

TEST(CudaDevicePool, ReservedIsWhatTheGpuLost) {
  SKIP_WITHOUT_GPU();
  ASSERT_EQ(cudaFree(nullptr), cudaSuccess);  // the context exists before the first measurement
  const size_t before = free_bytes();
  {
    anvil::DevicePool pool(std::make_unique<anvil::CudaDeviceMemory>(0));
    std::vector<void*> got;
    for (size_t bytes : {size_t{1000}, size_t{3} << 20, size_t{64} << 20, size_t{100}})
      got.push_back(pool.allocate(bytes, anvil::MemCategory::activations, "t"));
    for (void* p : got) ASSERT_EQ(cudaMemset(p, 0x5a, 100), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const anvil::DevicePoolStats s = pool.stats();
    std::printf("%s: reserved %zu bytes in %lld segments; the GPU lost %zu\n", pool.memory().name().c_str(), s.reserved,
                static_cast<long long>(s.segments), before - free_bytes());
    EXPECT_EQ(before - free_bytes(), s.reserved);
    EXPECT_THROW(pool.allocate(size_t{1} << 50, anvil::MemCategory::parameters, "too.big"), anvil::OutOfMemoryError);
    for (void* p : got) pool.deallocate(p);
    pool.empty_cache();
    EXPECT_EQ(free_bytes(), before);
  }
}

}  // namespace
