#include "anvil/ops/cuda/device_runtime.h"

#include <cstring>
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

// Small copies out of host memory (a micro-batch's tokens, block-causal
// attention's documents, a few per step) go through pinned staging: a copy
// from pageable memory may make the driver wait for the stream before it
// stages the bytes, which would stall the host inside a step; one from
// pinned memory is truly asynchronous. Eight 1 MiB chunks used in turn, each
// reused once the copy it staged has been read (its event; the wait is only
// the GPU falling eight copies behind). Larger copies (checkpoints, the
// model's state) go directly; so does everything if pinned memory cannot be had.
class PinnedStaging {
 public:
  static constexpr size_t kChunkBytes = size_t{1} << 20;
  static constexpr int kChunks = 8;

  // Stages src and enqueues its copy to dst on the stream; false (nothing
  // done) where it does not fit a chunk or there is no staging memory.
  bool copy_to_device(void* dst, const void* src, size_t bytes) {
    if (bytes > kChunkBytes) return false;
    const std::lock_guard lock(mutex_);
    if (!made_ && !make()) return false;
    Chunk& c = chunks_[next_];
    next_ = (next_ + 1) % kChunks;
    if (c.staged) check(cudaEventSynchronize(c.read), "cudaEventSynchronize on a staging chunk");
    std::memcpy(c.host, src, bytes);
    check(cudaMemcpyAsync(dst, c.host, bytes, cudaMemcpyHostToDevice, cuda_stream()), "cudaMemcpyAsync (staged)");
    check(cudaEventRecord(c.read, cuda_stream()), "cudaEventRecord after a staged copy");
    c.staged = true;
    return true;
  }

 private:
  struct Chunk {
    void* host = nullptr;
    cudaEvent_t read = nullptr;
    bool staged = false;
  };
  // Once; never freed (the runtime lives as long as the process).
  bool make() {
    if (tried_) return false;
    tried_ = true;
    void* base = nullptr;
    if (cudaHostAlloc(&base, kChunkBytes * kChunks, cudaHostAllocDefault) != cudaSuccess) {
      (void)cudaGetLastError();  // not sticky: copies go directly instead
      return false;
    }
    for (int i = 0; i < kChunks; ++i) {
      chunks_[i].host = static_cast<char*>(base) + static_cast<size_t>(i) * kChunkBytes;
      check(cudaEventCreateWithFlags(&chunks_[i].read, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    }
    made_ = true;
    return true;
  }
  std::mutex mutex_;
  Chunk chunks_[kChunks];
  int next_ = 0;
  bool made_ = false, tried_ = false;
};

class CudaRuntime : public DeviceRuntime {
 public:
  void copy(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) override {
    if (src_device.is_cpu() && !dst_device.is_cpu() && staging_.copy_to_device(dst, src, bytes)) return;
    check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, cuda_stream()), "cudaMemcpyAsync");
    // A copy into host memory returns with the bytes there; one out of
    // (pageable) host memory has been staged by the time the call returns.
    if (dst_device.is_cpu()) check(cudaStreamSynchronize(cuda_stream()), "cudaStreamSynchronize after a copy to the host");
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
  PinnedStaging staging_;
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
