#include "anvil/ops/cuda/device_runtime.h"

#include <memory>
#include <mutex>

#include "anvil/core/device.h"
#include "anvil/core/error.h"
#include "anvil/cuda/device_memory.h"
#include "anvil/ops/cuda/cast.h"

namespace anvil {

namespace {

void check(cudaError_t e, const char* what) { ANVIL_CHECK(e == cudaSuccess, what, ": ", cudaGetErrorString(e)); }

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
