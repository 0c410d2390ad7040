#include "anvil/core/tensor.h"

#include <cstring>

#include "anvil/core/device_pool.h"
#include "anvil/core/dry_run.h"
#include "anvil/core/op_timer.h"
#include "anvil/core/parallel_for.h"

namespace anvil {

std::string shape_str(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

Buffer::Buffer(size_t bytes, MemCategory category, std::string_view tag, Device device)
    : device_(device), bytes_(bytes), category_(category) {
  if (device.is_cpu()) {
    host_ = &TrackingAllocator::instance();
    data_ = host_->allocate(bytes, category, tag);
  } else {
    pool_ = &device_pool(device);
    data_ = pool_->allocate(bytes, category, tag);
  }
}

Buffer::~Buffer() {
  if (host_)
    host_->deallocate(data_);
  else
    pool_->deallocate(data_);
}

Tensor Tensor::empty(Shape shape, DType dtype, MemCategory category, std::string_view tag, Device device) {
  for (int64_t d : shape) ANVIL_CHECK(d >= 0, "tensor '", tag, "': negative dimension in shape ", shape_str(shape));
  Tensor t;
  t.dtype_ = dtype;
  t.shape_ = std::move(shape);
  t.buffer_ = std::make_shared<Buffer>(t.nbytes(), category, tag, device);
  return t;
}

Tensor Tensor::zeros(Shape shape, DType dtype, MemCategory category, std::string_view tag, Device device) {
  Tensor t = empty(std::move(shape), dtype, category, tag, device);
  t.zero_();
  return t;
}

void Tensor::refuse_host_access() const {
  throw Error(detail::concat("a ", dtype_name(dtype_), " tensor of shape ", shape_str(shape_), " (",
                             category_name(category()), ") is on ", device().str(),
                             ": host code cannot read or write it; copy it with to(Device::cpu(), ...) first"));
}

int64_t Tensor::size(int dim) const {
  const int d = dim < 0 ? dim + ndim() : dim;
  ANVIL_ASSERT(d >= 0 && d < ndim(), "dim ", dim, " out of range for shape ", shape_str(shape_));
  return shape_[d];
}

Tensor Tensor::view(Shape shape) const {
  ANVIL_ASSERT(shape_numel(shape) == numel(), "cannot view ", shape_str(shape_), " as ", shape_str(shape));
  Tensor t = *this;
  t.shape_ = std::move(shape);
  return t;
}

Tensor Tensor::slice(int64_t start, int64_t length) const {
  ANVIL_ASSERT(ndim() >= 1 && start >= 0 && length >= 0 && start + length <= shape_[0], "slice [", start, ", ",
               start + length, ") out of range for ", shape_str(shape_));
  Tensor t = *this;
  const int64_t row = numel() / std::max<int64_t>(1, shape_[0]);
  t.offset_bytes_ += static_cast<size_t>(start * row) * dtype_size(dtype_);
  t.shape_[0] = length;
  return t;
}

void Tensor::zero_() {
  if (dry_run()) return;
  const ScopedOpTime op("zero");
  if (!device().is_cpu()) return device_runtime(device()).zero(raw(), device(), nbytes());
  char* p = static_cast<char*>(raw());
  const int64_t n = static_cast<int64_t>(nbytes());
  parallel_for(0, n, 1 << 20, [&](int64_t lo, int64_t hi) { std::memset(p + lo, 0, static_cast<size_t>(hi - lo)); });
}

void Tensor::copy_from(const Tensor& src) {
  const ScopedOpTime op("copy");
  ANVIL_ASSERT(src.numel() == numel(), "copy of ", shape_str(src.shape_), " into ", shape_str(shape_));
  if (!device().is_cpu() || !src.device().is_cpu()) return copy_across_devices(src);
  if (dry_run()) return;
  if (src.dtype_ == dtype_) {
    char* d = static_cast<char*>(raw());
    const char* s = static_cast<const char*>(src.raw());
    const int64_t n = static_cast<int64_t>(nbytes());
    parallel_for(0, n, 1 << 20, [&](int64_t lo, int64_t hi) { std::memcpy(d + lo, s + lo, static_cast<size_t>(hi - lo)); });
  } else if (src.dtype_ == DType::f32 && dtype_ == DType::bf16) {
    convert_f32_to_bf16(src.data<float>(), data<bf16>(), numel());
  } else if (src.dtype_ == DType::bf16 && dtype_ == DType::f32) {
    convert_bf16_to_f32(src.data<bf16>(), data<float>(), numel());
  } else {
    ANVIL_ASSERT(false, "no conversion from ", dtype_name(src.dtype_), " to ", dtype_name(dtype_));
  }
}

// A device takes part: the bytes cross as they are, and a dtype conversion
// runs where the destination is, after them (one code path for either way).
// (A dry run makes the staging tensor and moves nothing.)
void Tensor::copy_across_devices(const Tensor& src) {
  if (src.dtype_ != dtype_ && device() != src.device()) {
    // Across: bring src over as it is, then convert where the destination is.
    const Tensor moved = src.to(device(), MemCategory::workspace, "tensor.copy_across_devices");
    return copy_from(moved);
  }
  if (dry_run()) return;
  const Device gpu = device().is_cpu() ? src.device() : device();
  DeviceRuntime& runtime = device_runtime(gpu);
  if (src.dtype_ == dtype_) return runtime.copy(raw(), device(), src.raw(), src.device(), nbytes());
  runtime.convert(raw(), dtype_, src.raw(), src.dtype_, numel(), gpu);  // on one GPU
}

Tensor Tensor::to(DType dtype, MemCategory category, std::string_view tag) const {
  Tensor t = empty(shape_, dtype, category, tag, device());
  t.copy_from(*this);
  return t;
}

Tensor Tensor::to(Device device, MemCategory category, std::string_view tag) const {
  Tensor t = empty(shape_, dtype_, category, tag, device);
  t.copy_from(*this);
  return t;
}

float Tensor::item_f32(int64_t i) const {
  ANVIL_ASSERT(i >= 0 && i < numel());
  if (!device().is_cpu()) return view({numel()}).slice(i, 1).to(Device::cpu(), MemCategory::workspace, "item").item_f32(0);
  switch (dtype_) {
    case DType::f32: return data<float>()[i];
    case DType::bf16: return to_f32(data<bf16>()[i]);
    case DType::i32: return static_cast<float>(data<int32_t>()[i]);
  }
  return 0;
}

}  // namespace anvil
