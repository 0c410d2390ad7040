// Where a tensor's bytes live — the host or a GPU — and what core needs from
// a GPU to move them. Core knows no CUDA: the CUDA backend registers its
// runtime and its pools here at start-up (ops/cuda/device_runtime.h), and a
// dry run of a GPU job installs a pool over a fake device memory instead
// (core/dry_run.h), so a binary without CUDA still runs the GPU path's
// allocations.
//
// Tensors are made on the scoped default device (ScopedDevice; the host
// unless a scope says otherwise, per thread), so modules allocate where the
// job runs without naming a device: the model, its checkpointing policies and
// the trainer have no device branch. Ops dispatch on their tensors' device.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "anvil/core/dtype.h"

namespace anvil {

class DeviceClock;
class DeviceMemory;
class DevicePool;

enum class DeviceKind : uint8_t { cpu, cuda };

struct Device {
  DeviceKind kind = DeviceKind::cpu;
  int index = 0;  // among the visible GPUs; 0 for the host
  static constexpr Device cpu() { return {}; }
  static constexpr Device cuda(int index = 0) { return {DeviceKind::cuda, index}; }
  bool is_cpu() const { return kind == DeviceKind::cpu; }
  bool operator==(const Device&) const = default;
  std::string str() const;  // "cpu", "cuda:0"
};

// Where Tensor::empty allocates on this thread: the innermost ScopedDevice's,
// else the host. (The data loader's and checkpoint writer's threads stay on
// the host whatever the trainer's thread does.)
Device default_device();
class ScopedDevice {
 public:
  explicit ScopedDevice(Device device);
  ~ScopedDevice();
  ScopedDevice(const ScopedDevice&) = delete;
  ScopedDevice& operator=(const ScopedDevice&) = delete;

 private:
  Device previous_;
};

// One GPU as its driver describes it: what the trainer holds a job's memory
// against and names its MFU peak by.
struct DeviceProperties {
  std::string name;         // "NVIDIA H200"
  size_t memory_bytes = 0;  // the whole device's
};

// What core asks of a GPU. Every operation is ordered on the device's one
// compute stream; a copy into host memory returns once the bytes are there,
// one out of host memory once the host bytes may be reused.
class DeviceRuntime {
 public:
  virtual ~DeviceRuntime() = default;
  // `bytes` from src to dst; at least one of the two devices is this runtime's.
  virtual void copy(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) = 0;
  virtual void zero(void* dst, Device device, size_t bytes) = 0;
  // n elements converted on the device (f32 ↔ bf16, rounding to nearest even as bf16::from_float).
  virtual void convert(void* dst, DType dst_dtype, const void* src, DType src_dtype, int64_t n, Device device) = 0;
  // The memory device `index`'s pool maps its segments from (cudaMalloc on a GPU).
  virtual std::unique_ptr<DeviceMemory> memory(int index) = 0;
  // The GPUs of this kind the process can use; 0, with the reason in
  // *why_none (no driver, no device), when there is none.
  virtual int device_count(std::string* why_none) = 0;
  virtual DeviceProperties properties(int index) = 0;
  // Stamps on the stream, in its order: op times on a GPU (core/op_timer.h).
  virtual DeviceClock& clock() = 0;
};

// Registers the runtime of `kind` (not owned; null removes it). The CUDA
// backend registers its own; tests register a host-backed one.
void set_device_runtime(DeviceKind kind, DeviceRuntime* runtime);
// The runtime of d's kind; throws anvil::Error naming d when none is
// registered (a binary built without CUDA, or before start-up registered it).
DeviceRuntime& device_runtime(Device d);

// The pool every tensor on device d comes from: a dry run's fake one while it
// is installed, else the runtime's, made on first use over its memory.
DevicePool& device_pool(Device d);
// Returns every device pool's wholly free segments to its device
// (torch.cuda.empty_cache()), where the trainer releases the host's block
// cache (TrackingAllocator::release_cache): after setup's one-off tensors and
// around one-off work, whose freed blocks later requests would split.
void empty_device_caches();
// Installs `pool` as device d's (not owned; null goes back to the runtime's):
// the dry run's fake device, and tests.
void install_device_pool(Device d, DevicePool* pool);

}  // namespace anvil
