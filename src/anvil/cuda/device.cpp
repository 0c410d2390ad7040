#include "anvil/cuda/device.h"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <cudnn.h>

#include <cstdio>

#include "anvil/core/error.h"

namespace anvil {

std::vector<CudaDeviceInfo> cuda_devices(std::string* why_none) {
  std::vector<CudaDeviceInfo> out;
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    // No driver or no device: the runtime says which. Clear the sticky error so
    // a later call starts clean.
    (void)cudaGetLastError();
    int driver = 0;
    if (why_none)
      *why_none = err == cudaErrorInsufficientDriver && cudaDriverGetVersion(&driver) == cudaSuccess && driver == 0
                      ? "no NVIDIA driver is loaded on this machine"
                      : detail::concat(cudaGetErrorName(err), ": ", cudaGetErrorString(err));
    return out;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp p{};
    const cudaError_t e = cudaGetDeviceProperties(&p, i);
    ANVIL_CHECK(e == cudaSuccess, "cudaGetDeviceProperties(", i, ") failed: ", cudaGetErrorString(e));
    out.push_back({i, p.name, p.major, p.minor, p.multiProcessorCount, p.totalGlobalMem});
  }
  if (out.empty() && why_none) *why_none = "the CUDA runtime reports no device";
  return out;
}

CudaLibraryVersions cuda_library_versions() {
  CudaLibraryVersions v;
  (void)cudaRuntimeGetVersion(&v.runtime);
  if (cudaDriverGetVersion(&v.driver) != cudaSuccess) v.driver = 0;
  int major = 0, minor = 0, patch = 0;
  // cublasGetProperty needs no handle (a handle would need a GPU).
  if (cublasGetProperty(MAJOR_VERSION, &major) == CUBLAS_STATUS_SUCCESS &&
      cublasGetProperty(MINOR_VERSION, &minor) == CUBLAS_STATUS_SUCCESS &&
      cublasGetProperty(PATCH_LEVEL, &patch) == CUBLAS_STATUS_SUCCESS)
    v.cublas = major * 10000 + minor * 100 + patch;
  v.cublaslt = cublasLtGetVersion();
  v.cudnn = cudnnGetVersion();
  v.cudnn_built = CUDNN_VERSION;
  return v;
}

namespace {

std::string dotted(size_t x) { return detail::concat(x / 10000, ".", x / 100 % 100, ".", x % 100); }

}  // namespace

void warn_if_cudnn_is_older() {
  CudaLibraryVersions v;  // only cuDNN is asked: the other libraries' versions play no part
  v.cudnn = cudnnGetVersion();
  v.cudnn_built = CUDNN_VERSION;
  if (const std::string warning = cudnn_version_warning(v); !warning.empty())
    std::fprintf(stderr, "%s\n", warning.c_str());
}

std::string cudnn_version_warning(const CudaLibraryVersions& v) {
  if (v.cudnn >= v.cudnn_built) return "";
  return detail::concat("warning: cuDNN ", dotted(v.cudnn), " is loaded, older than the cuDNN ", dotted(v.cudnn_built),
                        " Anvil was built against; cuDNN does not promise to run with an older version than that");
}

std::string cuda_report() {
  const CudaLibraryVersions v = cuda_library_versions();
  std::string s = detail::concat("CUDA runtime: ", v.runtime / 1000, ".", v.runtime % 1000 / 10, " (static); driver: ",
                                 v.driver ? detail::concat(v.driver / 1000, ".", v.driver % 1000 / 10) : "none",
                                 "; cuBLAS ", dotted(static_cast<size_t>(v.cublas)), ", cuBLASLt ", dotted(v.cublaslt),
                                 ", cuDNN ", dotted(v.cudnn), " (built against ", dotted(v.cudnn_built), ")\n");
  if (const std::string warning = cudnn_version_warning(v); !warning.empty()) s += warning + "\n";
  std::string why;
  const auto devices = cuda_devices(&why);
  if (devices.empty()) s += "CUDA devices: none (" + why + ")\n";
  for (const auto& d : devices) {
    char mem[32];
    std::snprintf(mem, sizeof mem, "%.1f GiB", static_cast<double>(d.memory_bytes) / (1u << 30));
    s += detail::concat("CUDA device ", d.index, ": ", d.name, ", compute capability ", d.cc_major, ".", d.cc_minor,
                        ", ", d.multiprocessors, " SMs, ", mem, "\n");
  }
  return s;
}

}  // namespace anvil
