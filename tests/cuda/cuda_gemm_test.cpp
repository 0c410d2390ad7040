// cuBLASLt products (ops/cuda/gemm.h) against the CPU gemm() on the same
// operands, for every kind of product a training step makes (the list
// gemm_layout_test.cpp replays on the host, ../gemm_check.h): both within the
// f32 accumulation bound of a double-precision reference, with every element
// outside the output's rows left untouched. The operands sit at the callers'
// offsets, so many are not 256-byte aligned (the heuristic must be told). An
// f32 product of short K run in TF32 would miss the bound many times over
// (operands rounded to 10 mantissa bits: ~2⁻¹⁰/√K of the magnitude against
// γ ≈ K·2⁻²⁴), so the f32 cases also prove TF32 off.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <string>
#include <vector>

#include "../gemm_check.h"
#include "anvil/core/error.h"
#include "anvil/ops/cuda/gemm.h"
#include "cuda_test_util.h"

namespace {

using namespace anvil;
using namespace anvil::gemm_check;

void cuda_check(cudaError_t e, const char* what) { ANVIL_CHECK(e == cudaSuccess, what, ": ", cudaGetErrorString(e)); }

// A host buffer's copy on the GPU.
class DeviceCopy {
 public:
  explicit DeviceCopy(const ElementBuffer& host) : bytes_(host.bytes()) {
    cuda_check(cudaMalloc(&ptr_, bytes_), "cudaMalloc");
    cuda_check(cudaMemcpy(ptr_, const_cast<ElementBuffer&>(host).data(), bytes_, cudaMemcpyHostToDevice),
               "cudaMemcpy to the GPU");
  }
  ~DeviceCopy() { cudaFree(ptr_); }
  DeviceCopy(const DeviceCopy&) = delete;
  DeviceCopy& operator=(const DeviceCopy&) = delete;
  char* at(const ElementBuffer& host, int64_t offset) const {
    return static_cast<char*>(ptr_) + offset * static_cast<int64_t>(dtype_size(host.type));
  }
  void copy_to(ElementBuffer& host) const {
    cuda_check(cudaMemcpy(host.data(), ptr_, bytes_, cudaMemcpyDeviceToHost), "cudaMemcpy from the GPU");
  }

 private:
  void* ptr_ = nullptr;
  size_t bytes_;
};

// The workspace every product shares, as the device pool will hold it (cudaMalloc aligns to 256 bytes).
void* workspace() {
  static void* ws = [] {
    void* p = nullptr;
    cuda_check(cudaMalloc(&p, kCublasLtWorkspaceBytes), "cudaMalloc of the cuBLASLt workspace");
    return p;
  }();
  return ws;
}

void expect_gpu_matches_cpu(const Product& p, uint32_t seed) {
  SCOPED_TRACE(p.kind);
  Operands cpu = make_operands(p, seed);
  Operands gpu = make_operands(p, seed);
  const Reference ref = reference(p, cpu);
  run_cpu(p, cpu);

  const DeviceCopy a(gpu.a), b(gpu.b), c(gpu.c);
  cudaStream_t stream = nullptr;
  cuda_check(cudaStreamCreate(&stream), "cudaStreamCreate");
  gemm_cuda(lt_matmul_of(p.s, p.batch), a.at(gpu.a, p.a_offset), b.at(gpu.b, p.b_offset), c.at(gpu.c, p.c_offset),
            workspace(), kCublasLtWorkspaceBytes, stream);
  cuda_check(cudaStreamSynchronize(stream), "the product");
  cuda_check(cudaStreamDestroy(stream), "cudaStreamDestroy");
  c.copy_to(gpu.c);

  const Measured on_cpu = check("CPU gemm", p, cpu.c, ref);
  const Measured on_gpu = check("cuBLASLt", p, gpu.c, ref);
  std::printf("%-58s K=%-4ld bound γ=%.2e%s | CPU gemm %.2e (rel %.2e) | cuBLASLt %.2e (rel %.2e)\n", p.kind.c_str(),
              long(p.s.K), bound_of(p.s).gamma, p.s.c == DType::bf16 ? " +2^-8|C|" : "         ", on_cpu.max_error,
              on_cpu.max_relative, on_gpu.max_error, on_gpu.max_relative);
}

// Shapes big enough for cuBLASLt's tensor-core kernels, split-K (a long K
// against a small output) among them, which the workspace serves; still odd.
std::vector<Product> large_products() {
  std::vector<Product> out;
  for (const DType dt : {DType::f32, DType::bf16}) {
    const std::string t = dtype_name(dt);
    out.push_back({"large linear forward " + t, {.M = 259, .N = 515, .K = 1031, .trans_b = true, .ab = dt, .c = dt}});
    out.push_back({"large weight gradient, long K (split-K) " + t,
                   {.M = 67, .N = 45, .K = 4099, .trans_a = true, .ab = dt, .c = DType::f32, .accumulate = true}});
  }
  return out;
}

}  // namespace

TEST(CudaGemm, TrainingProductsMatchTheCpuGemm) {
  SKIP_WITHOUT_GPU();
  uint32_t seed = 1;
  for (const auto& products : {linear_products(), lm_head_products(), attention_tile_products(), strided_row_products(),
                               strided_batch_products(), large_products()})
    for (const Product& p : products) expect_gpu_matches_cpu(p, seed++);
}

// A later product of a signature runs on the cached plan: the same operands
// give the same result bit for bit (no algorithm change between calls).
TEST(CudaGemm, RepeatedProductIsDeterministic) {
  SKIP_WITHOUT_GPU();
  const Product p = linear_products()[1];  // bf16 -> bf16
  Operands host = make_operands(p, 7);
  const DeviceCopy a(host.a), b(host.b);
  std::vector<ElementBuffer> results;
  for (int run = 0; run < 2; ++run) {
    const DeviceCopy c(host.c);
    gemm_cuda(lt_matmul_of(p.s), a.at(host.a, 0), b.at(host.b, 0), c.at(host.c, 0), workspace(),
              kCublasLtWorkspaceBytes, nullptr);
    cuda_check(cudaDeviceSynchronize(), "the product");
    results.push_back(host.c);
    c.copy_to(results.back());
  }
  EXPECT_EQ(results[0].b16.size(), results[1].b16.size());
  for (size_t i = 0; i < results[0].b16.size(); ++i)
    ASSERT_EQ(results[0].b16[i].bits, results[1].b16[i].bits) << "element " << i;
}

TEST(CudaGemm, ErrorsNameTheCallAndTheShape) {
  SKIP_WITHOUT_GPU();
  const Product p = linear_products()[0];
  Operands host = make_operands(p, 9);
  const DeviceCopy a(host.a), b(host.b), c(host.c);
  try {
    gemm_cuda(lt_matmul_of(p.s), a.at(host.a, 0), b.at(host.b, 0), c.at(host.c, 0),
              static_cast<char*>(workspace()) + 16, kCublasLtWorkspaceBytes - 16, nullptr);
    ADD_FAILURE() << "a misaligned workspace was taken";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("workspace"), std::string::npos) << what;
    const std::string shape =
        "m=" + std::to_string(p.s.N) + " n=" + std::to_string(p.s.M) + " k=" + std::to_string(p.s.K);
    EXPECT_NE(what.find(shape), std::string::npos) << what;
  }
}
