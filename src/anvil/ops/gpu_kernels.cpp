#include "anvil/ops/gpu_kernels.h"

#include <map>
#include <mutex>

#include "anvil/core/dry_run.h"
#include "anvil/core/error.h"

namespace anvil {

namespace {
std::mutex g_mutex;
GpuKernels* g_kernels = nullptr;
// cuBLASLt's workspace per GPU index: the process's (never destroyed, as the
// device pools: the CUDA runtime may be gone before static destructors run),
// and a dry run's (dropped with the dry run).
std::map<int, Tensor>& g_workspaces = *new std::map<int, Tensor>;
std::map<int, Tensor> g_dry_workspaces;
}  // namespace

void check_same_device(std::string_view op, const Tensor& first, const Tensor& other) {
  ANVIL_CHECK(!other.defined() || other.device() == first.device(), op, ": tensors on ", first.device().str(),
              " and ", other.device().str(), "; an op's tensors must be on one device");
}

void set_gpu_kernels(GpuKernels* kernels) {
  const std::lock_guard<std::mutex> lock(g_mutex);
  g_kernels = kernels;
}

GpuKernels& gpu_kernels(std::string_view op) {
  const std::lock_guard<std::mutex> lock(g_mutex);
  ANVIL_CHECK(g_kernels != nullptr, op,
              ": the tensors are on a GPU, but this binary has no GPU kernels (it was built without CUDA); build "
              "with -DANVIL_CUDA=ON, or keep the tensors on the host");
  return *g_kernels;
}

const Tensor& gemm_workspace(Device device) {
  ANVIL_ASSERT(!device.is_cpu(), "gemm_workspace is a GPU's");
  const std::lock_guard<std::mutex> lock(g_mutex);
  std::map<int, Tensor>& kept = dry_run() ? g_dry_workspaces : g_workspaces;
  auto it = kept.find(device.index);
  if (it == kept.end()) {
    if (dry_run() && g_dry_workspaces.empty())
      DryRun::release_at_end([] {
        const std::lock_guard<std::mutex> relock(g_mutex);
        g_dry_workspaces.clear();
      });
    it = kept.emplace(device.index, Tensor::empty({static_cast<int64_t>(kCublasLtWorkspaceBytes / 4)}, DType::f32,
                                                  MemCategory::workspace, "cublaslt.workspace", device))
             .first;
  }
  return it->second;
}

void gpu_gemm(Device device, const GemmShape& s, const void* A, const void* B, void* C, const GemmBatch& batch) {
  if (s.M == 0 || s.N == 0 || batch.count == 0) return;
  if (s.K == 0) {
    ANVIL_ASSERT(s.accumulate, "gemm with K = 0 must accumulate");  // C += 0: nothing to do
    return;
  }
  const LtMatmul call = lt_matmul_of(s, batch);
  const Tensor& workspace = gemm_workspace(device);
  if (dry_run()) return;
  gpu_kernels("gemm").gemm(call, A, B, C, workspace.raw(), workspace.nbytes());
}

}  // namespace anvil
