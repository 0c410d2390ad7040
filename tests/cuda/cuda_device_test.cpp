// The CUDA build's first checks. Without a GPU (CI never has one) the library
// versions are still checked and the GPU tests skip with one line saying why;
// on a GPU the cast kernel must equal the CPU's conversion bit for bit.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "anvil/core/dtype.h"
#include "anvil/cuda/device.h"
#include "anvil/ops/cuda/cast.h"
#include "cuda_test_util.h"

namespace {

void check(cudaError_t e, const char* what) { ASSERT_EQ(e, cudaSuccess) << what << ": " << cudaGetErrorString(e); }

}  // namespace

// The binary was built against CUDA 13 and cuDNN 9 and loads their libraries:
// the versions the libraries report are those majors (no GPU needed).
TEST(CudaLibraries, AreCuda13AndCudnn9) {
  const anvil::CudaLibraryVersions v = anvil::cuda_library_versions();
  std::printf("%s", anvil::cuda_report().c_str());
  EXPECT_EQ(v.runtime / 1000, 13) << v.runtime;
  EXPECT_EQ(v.cublas / 10000, 13) << v.cublas;
  EXPECT_EQ(v.cublaslt / 10000, 13u) << v.cublaslt;
  EXPECT_EQ(v.cudnn / 10000, 9u) << v.cudnn;
}

TEST(CudaDevice, ReportsItsProperties) {
  SKIP_WITHOUT_GPU();
  for (const auto& d : anvil::cuda_devices()) {
    EXPECT_FALSE(d.name.empty());
    EXPECT_GE(d.cc_major, 8) << d.name << ": the build carries SASS for sm_80 and sm_90a and PTX for compute_80";
    EXPECT_GT(d.multiprocessors, 0);
    EXPECT_GT(d.memory_bytes, size_t{1} << 30);
  }
}

// f32 -> bf16 on the GPU against bf16::from_float: ties both ways, the
// smallest subnormals, overflow to infinity, infinities, and a million random
// bit patterns. NaN must stay NaN (its payload may differ).
TEST(CudaCast, F32ToBf16EqualsTheCpuConversion) {
  SKIP_WITHOUT_GPU();
  std::vector<float> in = {0.0f, -0.0f, 1.0f, -1.0f, 1.00390625f /* 1 + 2^-8: a tie, rounds to even (down) */,
                           1.01171875f /* 1 + 3·2^-8: a tie, rounds up */, 3.3895314e38f /* the largest bf16 */,
                           std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                           std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::min(),
                           std::numeric_limits<float>::max() /* rounds to inf */,
                           std::numeric_limits<float>::quiet_NaN()};
  std::mt19937 rng(7);
  while (in.size() < (1u << 20) + 3) {  // not a multiple of the block, so the tail is covered
    const uint32_t u = rng();
    float f;
    std::memcpy(&f, &u, 4);
    in.push_back(f);
  }
  const int64_t n = static_cast<int64_t>(in.size());
  void *in_bytes = nullptr, *out_bytes = nullptr;
  check(cudaMalloc(&in_bytes, n * sizeof(float)), "cudaMalloc");
  check(cudaMalloc(&out_bytes, n * sizeof(uint16_t)), "cudaMalloc");
  auto* d_in = static_cast<float*>(in_bytes);
  auto* d_out = static_cast<uint16_t*>(out_bytes);
  check(cudaMemcpy(d_in, in.data(), n * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy to the GPU");
  anvil::cast_f32_to_bf16_cuda(d_in, d_out, n, nullptr);
  std::vector<uint16_t> out(in.size());
  check(cudaMemcpy(out.data(), d_out, n * sizeof(uint16_t), cudaMemcpyDeviceToHost), "cudaMemcpy from the GPU");
  check(cudaFree(d_in), "cudaFree");
  check(cudaFree(d_out), "cudaFree");
  size_t mismatches = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    const uint16_t want = anvil::bf16::from_float(in[i]);
    const bool ok = std::isnan(in[i]) ? std::isnan(anvil::bf16::to_float(out[i])) : out[i] == want;
    if (!ok && ++mismatches <= 5)
      ADD_FAILURE() << "element " << i << " (" << in[i] << "): GPU 0x" << std::hex << out[i] << ", CPU 0x" << want;
  }
  EXPECT_EQ(mismatches, 0u) << "of " << in.size();
}
