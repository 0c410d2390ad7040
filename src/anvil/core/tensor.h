// Tensor: a dtype, a shape and a view into a tracked buffer on a device (the
// host, or a GPU: core/device.h). Always contiguous (row-major); views share
// the buffer and keep it alive.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "anvil/core/allocator.h"
#include "anvil/core/device.h"
#include "anvil/core/dtype.h"
#include "anvil/core/error.h"

namespace anvil {

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& s);
int64_t shape_numel(const Shape& s);

// One tracked allocation; freed when the last tensor viewing it goes away.
// Host bytes come from the tracking allocator, a device's from its pool.
class Buffer {
 public:
  Buffer(size_t bytes, MemCategory category, std::string_view tag, Device device);
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  MemCategory category() const { return category_; }
  Device device() const { return device_; }

 private:
  // What made it (a dry run's, or the process's): the host's allocator, or the device's pool.
  TrackingAllocator* host_ = nullptr;
  DevicePool* pool_ = nullptr;
  Device device_;
  void* data_ = nullptr;
  size_t bytes_;
  MemCategory category_;
};

class Tensor {
 public:
  Tensor() = default;

  // Uninitialised memory on `device` (by default the scoped one): from the
  // tracking allocator on the host, from the device's pool on a GPU.
  static Tensor empty(Shape shape, DType dtype, MemCategory category, std::string_view tag,
                      Device device = default_device());
  static Tensor zeros(Shape shape, DType dtype, MemCategory category, std::string_view tag,
                      Device device = default_device());

  bool defined() const { return buffer_ != nullptr; }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  // Negative dims count from the end, as in PyTorch.
  int64_t size(int dim) const;
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  MemCategory category() const { return buffer_->category(); }
  Device device() const { return buffer_->device(); }

  // The first element's address in its device's memory (a kernel's argument).
  void* raw() const { return static_cast<char*>(buffer_->data()) + offset_bytes_; }
  // The elements for host code: a device tensor is refused (its bytes are not
  // the host's to read); copy it with to(Device::cpu(), …) first.
  template <class T>
  T* data() const {
    ANVIL_ASSERT(dtype_of<T>() == dtype_, "tensor is ", dtype_name(dtype_), ", accessed as ",
                 dtype_name(dtype_of<T>()));
    if (!device().is_cpu()) refuse_host_access();
    return static_cast<T*>(raw());
  }

  // Same elements, another shape (numel must match).
  Tensor view(Shape shape) const;
  // Rows [start, start + length) along dim 0.
  Tensor slice(int64_t start, int64_t length) const;

  // These work on any device, and copy_from across devices.
  void zero_();
  // Copies values from src (same numel), converting dtype if needed.
  void copy_from(const Tensor& src);
  // A new tensor holding the same values in `dtype`, on this tensor's device.
  Tensor to(DType dtype, MemCategory category, std::string_view tag) const;
  // A new tensor holding the same values on `device`.
  Tensor to(Device device, MemCategory category, std::string_view tag) const;
  // Element i as float (slow; for tests, debugging, and reading a device's loss).
  float item_f32(int64_t i) const;

 private:
  [[noreturn]] void refuse_host_access() const;
  void copy_across_devices(const Tensor& src);
  std::shared_ptr<Buffer> buffer_;
  size_t offset_bytes_ = 0;
  Shape shape_;
  DType dtype_ = DType::f32;
};

}  // namespace anvil
