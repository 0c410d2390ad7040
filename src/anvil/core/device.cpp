#include "anvil/core/device.h"

#include <array>
#include <map>
#include <vector>
#include <mutex>

#include "anvil/core/device_pool.h"
#include "anvil/core/error.h"

namespace anvil {

std::string Device::str() const { return is_cpu() ? "cpu" : "cuda:" + std::to_string(index); }

namespace {

thread_local Device t_default_device;

struct Registry {
  std::mutex mutex;
  DeviceRuntime* cuda = nullptr;
  std::map<int, std::unique_ptr<DevicePool>> runtime_pools;  // by GPU index
  std::map<int, DevicePool*> installed;                      // a dry run's or a test's
};

// Never destroyed: a pool's segments go back through the CUDA runtime, which
// may be torn down before static destructors run at exit.
Registry& registry() {
  static Registry* r = new Registry;
  return *r;
}

}  // namespace

Device default_device() { return t_default_device; }

ScopedDevice::ScopedDevice(Device device) : previous_(t_default_device) { t_default_device = device; }

ScopedDevice::~ScopedDevice() { t_default_device = previous_; }

void set_device_runtime(DeviceKind kind, DeviceRuntime* runtime) {
  ANVIL_ASSERT(kind == DeviceKind::cuda, "the host has no device runtime");
  Registry& r = registry();
  const std::lock_guard lock(r.mutex);
  r.cuda = runtime;
  r.runtime_pools.clear();  // pools map the old runtime's memory
}

DeviceRuntime& device_runtime(Device d) {
  Registry& r = registry();
  const std::lock_guard lock(r.mutex);
  ANVIL_CHECK(d.kind == DeviceKind::cuda && r.cuda != nullptr, "no runtime for ", d.str(),
              d.is_cpu() ? ": host memory needs none" : ": this binary has no CUDA backend (built with ANVIL_CUDA=OFF, "
                                                        "or without nvcc), so it cannot reach a GPU");
  return *r.cuda;
}

DevicePool& device_pool(Device d) {
  ANVIL_ASSERT(!d.is_cpu(), "host memory comes from the tracking allocator, not a device pool");
  Registry& r = registry();
  const std::lock_guard lock(r.mutex);
  if (const auto it = r.installed.find(d.index); it != r.installed.end()) return *it->second;
  auto& pool = r.runtime_pools[d.index];
  if (!pool) {
    ANVIL_CHECK(r.cuda != nullptr, "no memory for ", d.str(), ": this binary has no CUDA backend (built with "
                "ANVIL_CUDA=OFF, or without nvcc); a dry run (core/dry_run.h) makes the GPU path's "
                "allocations without one");
    pool = std::make_unique<DevicePool>(r.cuda->memory(d.index));
  }
  return *pool;
}

void empty_device_caches() {
  std::vector<DevicePool*> pools;
  {
    Registry& r = registry();
    const std::lock_guard lock(r.mutex);
    for (auto& [index, pool] : r.runtime_pools)
      if (!r.installed.count(index)) pools.push_back(pool.get());
    for (auto& [index, pool] : r.installed) pools.push_back(pool);
  }
  for (DevicePool* pool : pools) pool->empty_cache();
}

void install_device_pool(Device d, DevicePool* pool) {
  ANVIL_ASSERT(!d.is_cpu(), "the host has no device pool");
  Registry& r = registry();
  const std::lock_guard lock(r.mutex);
  if (pool)
    r.installed[d.index] = pool;
  else
    r.installed.erase(d.index);
}

}  // namespace anvil
