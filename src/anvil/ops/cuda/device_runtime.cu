#include "anvil/ops/cuda/device_runtime.h"

#include <memory>
#include <mutex>
#include <vector>

#include "anvil/core/device.h"
#include "anvil/core/error.h"
#include "anvil/core/op_timer.h"
#include "anvil/cuda/device.h"
#include "anvil/cuda/device_memory.h"
#include "anvil/ops/cuda/cast.h"

namespace anvil {

namespace {

void check(cudaError_t e, const char* what) { ANVIL_CHECK(e == cudaSuccess, what, ": ", cudaGetErrorString(e)); }

// Op times on the GPU: CUDA events recorded on the one stream, kept for
// reuse (creating an event per op would cost more than some ops do).
class EventClock : public DeviceClock {
 public:
  uint32_t stamp() override {
    if (next_ == events_.size()) {
      cudaEvent_t e = nullptr;
      check(cudaEventCreate(&e), "cudaEventCreate");
      events_.push_back(e);
    }
    check(cudaEventRecord(events_[next_], cuda_stream()), "cudaEventRecord");
    return static_cast<uint32_t>(next_++);
  }
  double seconds_between(uint32_t from, uint32_t to) override {
    check(cudaEventSynchronize(events_.at(to)), "cudaEventSynchronize");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, events_.at(from), events_.at(to)), "cudaEventElapsedTime");
    return ms * 1e-3;
  }
  void clear() override { next_ = 0; }

 private:
  std::vector<cudaEvent_t> events_;  // never destroyed: the runtime lives as long as the process
  size_t next_ = 0;
};

class CudaRuntime : public DeviceRuntime {
 public:
  void copy(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) override {
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, cuda_stream()), "cudaMemcpyAsync");
    // A copy into host memory returns with the bytes there; one out of
    // (pageable) host memory has been staged by the time the call returns.
    if (dst_device.is_cpu()) check(cudaStreamSynchronize(cuda_stream()), "cudaStreamSynchronize after a copy to the host");
    (void)src_device;
  }
  void zero(void* dst, Device, size_t bytes) override {
    check(cudaMemsetAsync(dst, 0, bytes, cuda_stream()), "cudaMemsetAsync");
  }
  void convert(void* dst, DType dst_dtype, const void* src, DType src_dtype, int64_t n, Device) override {
    if (src_dtype == DType::f32 && dst_dtype == DType::bf16)
      return cast_f32_to_bf16_cuda(static_cast<const float*>(src), static_cast<uint16_t*>(dst), n, cuda_stream());
    if (src_dtype == DType::bf16 && dst_dtype == DType::f32)
      return cast_bf16_to_f32_cuda(static_cast<const uint16_t*>(src), static_cast<float*>(dst), n, cuda_stream());
    throw Error(detail::concat("no conversion from ", dtype_name(src_dtype), " to ", dtype_name(dst_dtype),
                               " on the GPU"));
  }
  std::unique_ptr<DeviceMemory> memory(int index) override { return std::make_unique<CudaDeviceMemory>(index); }
  int device_count(std::string* why_none) override { return static_cast<int>(cuda_devices(why_none).size()); }
  DeviceProperties properties(int index) override {
    const std::vector<CudaDeviceInfo> gpus = cuda_devices();
    ANVIL_CHECK(index >= 0 && index < static_cast<int>(gpus.size()), "there is no GPU cuda:", index, " (",
                gpus.size(), " visible)");
    return {gpus[static_cast<size_t>(index)].name, gpus[static_cast<size_t>(index)].memory_bytes};
  }
  DeviceClock& clock() override { return clock_; }

 private:
  EventClock clock_;
};

}  // namespace

void register_cuda_runtime() {
  static CudaRuntime* runtime = new CudaRuntime;  // never destroyed: pools outlive static destructors
  static std::once_flag once;
  std::call_once(once, [] { set_device_runtime(DeviceKind::cuda, runtime); });
  register_cuda_kernels();
}

cudaStream_t cuda_stream() {
  static cudaStream_t stream = [] {
    cudaStream_t s = nullptr;
    check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
    return s;
  }();
  return stream;
}

}  // namespace anvil
