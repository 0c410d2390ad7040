// Tensors on a device (core/device.h, core/tensor.h), proved without a GPU:
// a stand-in runtime whose "device memory" is host memory moves the bytes
// with memcpy, so every cross-device path — allocation from the device's
// pool, the refusal of host access, zero, copies and conversions both ways,
// reading a scalar — runs here and is checked value for value. A dry run of
// a GPU job allocates on a fake device with no runtime at all.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

#include "anvil/core/device.h"
#include "anvil/core/device_pool.h"
#include "anvil/core/dry_run.h"
#include "host_backed_gpu.h"
#include "test_util.h"

namespace anvil {
namespace {

using testing::HostBackedGpu;

class DeviceTensor : public ::testing::Test {
 protected:
  void SetUp() override { set_device_runtime(DeviceKind::cuda, &gpu); }
  void TearDown() override { set_device_runtime(DeviceKind::cuda, nullptr); }
  HostBackedGpu gpu;
};

size_t pool_live(MemCategory c) { return device_pool(Device::cuda()).stats().live[static_cast<size_t>(c)]; }

TEST_F(DeviceTensor, ATensorMadeInADeviceScopeComesFromThatDevicesPool) {
  const size_t host_before = TrackingAllocator::instance().live_total();
  {
    const ScopedDevice on_gpu(Device::cuda());
    const Tensor a = Tensor::empty({3, 5}, DType::f32, MemCategory::activations, "a");
    EXPECT_EQ(a.device(), Device::cuda(0));
    EXPECT_EQ(pool_live(MemCategory::activations), 60u);
    EXPECT_EQ(TrackingAllocator::instance().live_total(), host_before);
    {
      const ScopedDevice on_host(Device::cpu());  // scopes nest
      EXPECT_TRUE(Tensor::empty({4}, DType::f32, MemCategory::workspace, "h").device().is_cpu());
    }
    EXPECT_EQ(Tensor::empty({4}, DType::bf16, MemCategory::workspace, "w").device(), Device::cuda(0));
    EXPECT_EQ(a.slice(1, 2).device(), Device::cuda(0));  // views keep their device
  }
  EXPECT_TRUE(Tensor::empty({1}, DType::f32, MemCategory::workspace, "after").device().is_cpu());
  EXPECT_EQ(pool_live(MemCategory::activations), 0u) << "a freed device tensor went back to its pool";
}

TEST_F(DeviceTensor, HostCodeCannotReachIntoIt) {
  const Tensor t = Tensor::empty({2, 3}, DType::bf16, MemCategory::gradients, "g", Device::cuda());
  const std::string e = testing::error_of([&] { (void)t.data<bf16>(); });
  EXPECT_NE(e.find("bf16 tensor of shape [2, 3] (gradients) is on cuda:0"), std::string::npos) << e;
  EXPECT_NE(e.find("to(Device::cpu()"), std::string::npos) << e;
  EXPECT_NE(t.raw(), nullptr);  // a kernel's argument stays available
}

TEST_F(DeviceTensor, ValuesCrossBothWaysAndConvertOnTheDevice) {
  const Tensor host = testing::random_tensor({7, 13}, DType::f32, "device_tensor.values");
  const Tensor dev = host.to(Device::cuda(), MemCategory::activations, "dev");
  EXPECT_EQ(gpu.copies, 1);
  const Tensor dev_bf16 = dev.to(DType::bf16, MemCategory::activations, "dev_bf16");  // on the device
  EXPECT_EQ(dev_bf16.device(), Device::cuda(0));
  EXPECT_EQ(gpu.converts, 1);
  const Tensor back = dev_bf16.to(Device::cpu(), MemCategory::workspace, "back");
  const Tensor want = host.to(DType::bf16, MemCategory::workspace, "want");
  EXPECT_TRUE(testing::same_bytes(back, want));
  EXPECT_EQ(dev.item_f32(40), host.item_f32(40));
  EXPECT_EQ(dev_bf16.item_f32(90), want.item_f32(90));

  // Across devices and dtypes at once: host bf16 into device f32, device f32 into host bf16.
  Tensor dev_f32 = Tensor::empty({7, 13}, DType::f32, MemCategory::activations, "dev_f32", Device::cuda());
  dev_f32.copy_from(want);
  Tensor host_bf16 = Tensor::empty({91}, DType::bf16, MemCategory::workspace, "host_bf16");
  host_bf16.copy_from(dev_f32);
  EXPECT_TRUE(testing::same_bytes(host_bf16, want));

  Tensor z = Tensor::zeros({5}, DType::f32, MemCategory::workspace, "z", Device::cuda());
  EXPECT_EQ(gpu.zeros, 1);
  for (int64_t i = 0; i < 5; ++i) EXPECT_EQ(z.item_f32(i), 0.0f);
}

TEST(DeviceTensorWithoutRuntime, SaysTheBinaryCannotReachAGpu) {
  const std::string e = testing::error_of(
      [] { (void)Tensor::empty({4}, DType::f32, MemCategory::workspace, "t", Device::cuda()); });
  EXPECT_NE(e.find("no CUDA backend"), std::string::npos) << e;
  EXPECT_NE(e.find("a dry run (core/dry_run.h) makes the GPU path's allocations"), std::string::npos) << e;
}

// The dry run of a GPU job needs no runtime: its fake device's pool takes
// every allocation, and zero and copies skip their bytes as on the host.
TEST(DeviceTensorWithoutRuntime, ADryRunAllocatesOnAFakeGpu) {
  constexpr size_t GiB = size_t{1} << 30;
  DryRun dry(80 * GiB);
  ASSERT_NE(dry.gpu_pool(), nullptr);
  {
    const ScopedDevice on_gpu(Device::cuda());
    Tensor w = Tensor::zeros({1024, 1024}, DType::bf16, MemCategory::parameters, "w");
    Tensor host = Tensor::empty({1024, 1024}, DType::bf16, MemCategory::workspace, "host", Device::cpu());
    w.copy_from(host);
    const Tensor x = Tensor::empty({3 << 20}, DType::f32, MemCategory::activations, "x");
    const DevicePoolStats s = dry.gpu_pool()->stats();
    EXPECT_EQ(s.live[static_cast<size_t>(MemCategory::parameters)], 2u << 20);
    EXPECT_EQ(s.live[static_cast<size_t>(MemCategory::activations)], 12u << 20);
    // w (2 MiB) maps a 20 MiB segment of the large pool; x (12 MiB) fits the 18 MiB left of it.
    EXPECT_EQ(s.reserved, size_t{20} << 20);
    EXPECT_EQ(s.segments, 1);
  }
  EXPECT_EQ(dry.gpu_pool()->stats().allocated, 0u);
}

// Tensors die on whatever thread drops them: the pool keeps its books under
// concurrent allocations and frees.
TEST_F(DeviceTensor, ThePoolKeepsItsBooksUnderConcurrentUse) {
  auto churn = [](int seed) {
    for (int i = 0; i < 2000; ++i)
      (void)Tensor::empty({64 + (seed * 7 + i) % 1000}, DType::f32, MemCategory::workspace, "t", Device::cuda());
  };
  std::thread a(churn, 1), b(churn, 2);
  a.join();
  b.join();
  const DevicePoolStats s = device_pool(Device::cuda()).stats();
  EXPECT_EQ(s.allocated, 0u);
  EXPECT_EQ(s.num_allocs, 4000);
}

}  // namespace
}  // namespace anvil
