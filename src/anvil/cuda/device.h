// The CUDA runtime as Anvil sees it: the GPUs this process can use and the
// versions of the CUDA libraries the binary runs with. Built only where CMake
// builds the CUDA backend (ANVIL_CUDA); nothing here needs a GPU to answer.
#pragma once
#include <cstddef>
#include <string>
#include <vector>

namespace anvil {

struct CudaDeviceInfo {
  int index = 0;
  std::string name;
  int cc_major = 0, cc_minor = 0;  // compute capability, e.g. 9.0 for H100/H200
  int multiprocessors = 0;
  size_t memory_bytes = 0;
};

// The visible GPUs; empty where there is none, with the runtime's reason (no
// driver, no device) in *why_none.
std::vector<CudaDeviceInfo> cuda_devices(std::string* why_none = nullptr);

// Versions as each library reports itself (no GPU needed): the CUDA runtime
// linked into the binary and the driver's CUDA version (0 without a driver) as
// 1000·major + 10·minor; cuBLAS and cuBLASLt as 10000·major + 100·minor + patch;
// cuDNN as 10000·major + 100·minor + patch, the one loaded (cudnn) and the
// one the binary was built against (cudnn_built: 9.14, cmake/cuda.cmake).
struct CudaLibraryVersions {
  int runtime = 0, driver = 0;
  int cublas = 0;
  size_t cublaslt = 0, cudnn = 0, cudnn_built = 0;
};
CudaLibraryVersions cuda_library_versions();

// One line saying that the loaded cuDNN is older than the one built against
// (cuDNN does not promise to run with an older minor version than that), or
// "" when it is not. Printed on standard error when a binary with the CUDA
// backend starts (warn_if_cudnn_is_older, from `anvil`'s main), and by `anvil info`.
std::string cudnn_version_warning(const CudaLibraryVersions& v);
void warn_if_cudnn_is_older();

// Lines for `anvil info`: the libraries, then each GPU or why there is none.
std::string cuda_report();

}  // namespace anvil
