#include "anvil/core/dry_run.h"

#include <mutex>
#include <vector>

#include "anvil/core/device.h"
#include "anvil/core/device_pool.h"
#include "anvil/core/error.h"

namespace anvil {

std::atomic<bool> detail::g_dry_run{false};

namespace {
std::mutex g_release_mutex;
std::vector<std::function<void()>>& releases() {
  static std::vector<std::function<void()>> r;
  return r;
}
}  // namespace

DryRun::DryRun(size_t gpu_memory) : allocator_(std::make_unique<TrackingAllocator>(/*dry=*/true)) {
  previous_ = TrackingAllocator::install(allocator_.get());
  ANVIL_ASSERT(previous_ == nullptr, "a dry run inside another dry run");
  if (gpu_memory > 0) {
    gpu_pool_ = std::make_unique<DevicePool>(std::make_unique<FakeDeviceMemory>(gpu_memory));
    install_device_pool(Device::cuda(0), gpu_pool_.get());
  }
  detail::g_dry_run.store(true);
}

DryRun::~DryRun() {
  std::vector<std::function<void()>> pending;
  {
    const std::lock_guard lock(g_release_mutex);
    pending.swap(releases());
  }
  for (const auto& release : pending) release();
  detail::g_dry_run.store(false);
  if (gpu_pool_) install_device_pool(Device::cuda(0), nullptr);
  TrackingAllocator::install(previous_);
}

void DryRun::release_at_end(std::function<void()> release) {
  const std::lock_guard lock(g_release_mutex);
  releases().push_back(std::move(release));
}

}  // namespace anvil
