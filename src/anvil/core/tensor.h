// Tensor: a dtype, a shape and a view into a tracked buffer. Always contiguous
// (row-major); views share the buffer and keep it alive.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "anvil/core/allocator.h"
#include "anvil/core/dtype.h"
#include "anvil/core/error.h"

namespace anvil {

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& s);
int64_t shape_numel(const Shape& s);

// One tracked allocation; freed when the last tensor viewing it goes away.
class Buffer {
 public:
  Buffer(size_t bytes, MemCategory category, std::string_view tag);
  ~Buffer();
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  MemCategory category() const { return category_; }

 private:
  TrackingAllocator& owner_;  // the allocator in use when it was made (a dry run's, or the process's)
  void* data_;
  size_t bytes_;
  MemCategory category_;
};

class Tensor {
 public:
  Tensor() = default;

  // Uninitialised memory from the tracking allocator.
  static Tensor empty(Shape shape, DType dtype, MemCategory category, std::string_view tag);
  static Tensor zeros(Shape shape, DType dtype, MemCategory category, std::string_view tag);

  bool defined() const { return buffer_ != nullptr; }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  // Negative dims count from the end, as in PyTorch.
  int64_t size(int dim) const;
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  MemCategory category() const { return buffer_->category(); }

  void* raw() const { return static_cast<char*>(buffer_->data()) + offset_bytes_; }
  template <class T>
  T* data() const {
    ANVIL_ASSERT(dtype_of<T>() == dtype_, "tensor is ", dtype_name(dtype_), ", accessed as ",
                 dtype_name(dtype_of<T>()));
    return static_cast<T*>(raw());
  }

  // Same elements, another shape (numel must match).
  Tensor view(Shape shape) const;
  // Rows [start, start + length) along dim 0.
  Tensor slice(int64_t start, int64_t length) const;

  void zero_();
  // Copies values from src (same shape), converting dtype if needed.
  void copy_from(const Tensor& src);
  // A new tensor holding the same values in `dtype`.
  Tensor to(DType dtype, MemCategory category, std::string_view tag) const;
  // Element i as float (slow; for tests and debugging).
  float item_f32(int64_t i) const;

 private:
  std::shared_ptr<Buffer> buffer_;
  size_t offset_bytes_ = 0;
  Shape shape_;
  DType dtype_ = DType::f32;
};

}  // namespace anvil
