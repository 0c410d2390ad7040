// cuDNN's fused SDPA (ops/cuda/sdpa.h, sdpa_graph.h) for Anvil's training
// shapes.
//
// On any host: the graphs, serialised by the frontend (no GPU needed), declare
// every tensor with exactly ops/sdpa_layout.h's dims and strides, bf16 data
// and f32 stats, the causal mask top-left with right bound 0 and the layout's
// scale; the binary is built against cuDNN 9.14 and loads no older one.
// Without a GPU the frontend's validate() is as far as a graph gets (it asks
// the CUDA runtime for the device's properties), and the errors name the
// graph, the shape, the step and the message of cuDNN (or the CUDA runtime).
//
// With a GPU: every training shape's graphs validate and build, and the
// forward's out and lse and the backward's dq, dk, dv match the CPU attention
// (ops/attention.h, f32 on the same bf16 inputs) on odd T with grouped-query
// heads, within the bounds stated at each check.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "anvil/core/error.h"
#include "anvil/cuda/device.h"
#include "anvil/ops/attention.h"
#include "anvil/ops/cuda/sdpa.h"
#include "anvil/ops/cuda/sdpa_graph.h"
#include "anvil/ops/sdpa_layout.h"
#include "cuda_test_util.h"

namespace {

using namespace anvil;
using nlohmann::json;

struct TrainingShape {
  const char* model;
  SdpaShape shape;
};

// configs/*.toml with model/args.cpp: debugmodel (dim 256, 16 heads, 16 kv
// heads: D 16; local batch 8, seq 256), Llama 3 1B (dim 2048, 32 heads, 8 kv:
// D 64) and 8B (dim 4096, 32, 8: D 128), both at local batch 1, seq 8192.
const TrainingShape kTrainingShapes[] = {
    {"debugmodel", {8, 256, 16, 16, 16, 0}},
    {"llama3_1b", {1, 8192, 32, 8, 64, 0}},
    {"llama3_8b", {1, 8192, 32, 8, 128, 0}},
};

SdpaLayout layout_of(const SdpaShape& s) { return sdpa_layout_of(s.B, s.T, s.Hq, s.Hkv, s.D, s.scale); }

json serialised(const cudnn_frontend::graph::Graph& g) {
  json j;
  g.serialize(j);
  return j;
}

void expect_tensor(const json& graph, const char* name, SdpaUid uid, const CudnnTensorLayout& l, const char* type) {
  SCOPED_TRACE(name);
  ASSERT_TRUE(graph["tensors"].contains(name)) << graph["tensors"].dump();
  const json& t = graph["tensors"][name];
  EXPECT_EQ(t["dim"].get<std::vector<int64_t>>(), std::vector<int64_t>(l.dim.begin(), l.dim.end()));
  EXPECT_EQ(t["stride"].get<std::vector<int64_t>>(), std::vector<int64_t>(l.stride.begin(), l.stride.end()));
  EXPECT_EQ(t["data_type"], type);
  EXPECT_EQ(t["uid"], static_cast<int64_t>(uid));
  EXPECT_EQ(t["is_virtual"], false);
}

// The SDPA node's options: Anvil's causal mask and scale (the frontend writes
// the scale as its float's bits in hex).
void expect_node(const json& graph, const char* tag, const SdpaLayout& l) {
  ASSERT_EQ(graph["nodes"].size(), 1u) << graph["nodes"].dump();
  const json& node = graph["nodes"][0];
  EXPECT_EQ(node["tag"], tag);
  EXPECT_EQ(node["diagonal_alignment"], "TOP_LEFT");
  EXPECT_EQ(node["right_bound"], 0);
  EXPECT_TRUE(node["left_bound"].is_null());
  char bits[16];
  std::snprintf(bits, sizeof bits, "%08X", std::bit_cast<uint32_t>(l.attn_scale));
  EXPECT_EQ(node["attn_scale_value"], bits) << "scale " << l.attn_scale;
  EXPECT_EQ(graph["context"]["io_data_type"], "BFLOAT16");
  EXPECT_EQ(graph["context"]["intermediate_data_type"], "FLOAT");
  EXPECT_EQ(graph["context"]["compute_data_type"], "FLOAT");
}

TEST(CudaSdpa, ForwardGraphDeclaresTheLayoutOfEveryTrainingShape) {
  for (const auto& [model, shape] : kTrainingShapes) {
    SCOPED_TRACE(model);
    const SdpaLayout l = layout_of(shape);
    const json g = serialised(*sdpa_forward_graph(l));
    expect_node(g, "SDPA_FWD", l);
    EXPECT_EQ(g["nodes"][0]["generate_stats"], true);
    expect_tensor(g, "q", SdpaUid::q, l.q, "BFLOAT16");
    expect_tensor(g, "k", SdpaUid::k, l.k, "BFLOAT16");
    expect_tensor(g, "v", SdpaUid::v, l.v, "BFLOAT16");
    expect_tensor(g, "o", SdpaUid::o, l.o, "BFLOAT16");
    expect_tensor(g, "stats", SdpaUid::stats, l.stats, "FLOAT");
    EXPECT_EQ(g["tensors"].size(), 5u) << g["tensors"].dump();
  }
}

TEST(CudaSdpa, BackwardGraphDeclaresTheLayoutOfEveryTrainingShape) {
  for (const auto& [model, shape] : kTrainingShapes) {
    SCOPED_TRACE(model);
    const SdpaLayout l = layout_of(shape);
    const json g = serialised(*sdpa_backward_graph(l));
    expect_node(g, "SDPA_BWD", l);
    expect_tensor(g, "q", SdpaUid::q, l.q, "BFLOAT16");
    expect_tensor(g, "k", SdpaUid::k, l.k, "BFLOAT16");
    expect_tensor(g, "v", SdpaUid::v, l.v, "BFLOAT16");
    expect_tensor(g, "o", SdpaUid::o, l.o, "BFLOAT16");
    expect_tensor(g, "dO", SdpaUid::d_o, l.o, "BFLOAT16");
    expect_tensor(g, "stats", SdpaUid::stats, l.stats, "FLOAT");
    expect_tensor(g, "dQ", SdpaUid::dq, l.q, "BFLOAT16");
    expect_tensor(g, "dK", SdpaUid::dk, l.k, "BFLOAT16");
    expect_tensor(g, "dV", SdpaUid::dv, l.v, "BFLOAT16");
    EXPECT_EQ(g["tensors"].size(), 9u) << g["tensors"].dump();
  }
}

TEST(CudaSdpa, GivenScaleReachesTheGraph) {
  const SdpaLayout l = layout_of({2, 33, 4, 2, 64, 0.3f});
  expect_node(serialised(*sdpa_forward_graph(l)), "SDPA_FWD", l);
  expect_node(serialised(*sdpa_backward_graph(l)), "SDPA_BWD", l);
}

TEST(CudaSdpa, BuiltAgainstCudnn914AndLoadsNoOlder) {
  const CudaLibraryVersions v = cuda_library_versions();
  EXPECT_EQ(v.cudnn_built, 91400u);
  EXPECT_GE(v.cudnn, v.cudnn_built);
  EXPECT_EQ(cudnn_version_warning(v), "");
  CudaLibraryVersions older = v;
  older.cudnn = 91300;
  EXPECT_EQ(cudnn_version_warning(older),
            "warning: cuDNN 9.13.0 is loaded, older than the cuDNN 9.14.0 Anvil was built against; cuDNN does not "
            "promise to run with an older version than that");
}

// Throws, and returns the message.
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no anvil::Error thrown";
  return "";
}

// D = 512 is beyond every head dim cuDNN 9.14's SDPA runs (256), so the graph
// fails with a GPU too, at validate or at a later step.
TEST(CudaSdpa, ErrorsNameTheGraphTheShapeTheStepAndCudnnsMessage) {
  const std::string fwd = error_of([] { (void)sdpa_forward_workspace_bytes({1, 64, 4, 2, 512, 0}); });
  EXPECT_NE(fwd.find("cuDNN SDPA forward graph (B=1 T=64 Hq=4 Hkv=2 D=512 scale=0, bf16, causal): "), std::string::npos)
      << fwd;
  EXPECT_NE(fwd.find(" failed: "), std::string::npos) << fwd;
  EXPECT_GT(fwd.size(), fwd.find(" failed: ") + 9) << "cuDNN's message is empty: " << fwd;
  const std::string bwd = error_of([] { (void)sdpa_backward_workspace_bytes({1, 64, 4, 2, 512, 0}); });
  EXPECT_NE(bwd.find("cuDNN SDPA backward graph (B=1 T=64 Hq=4 Hkv=2 D=512 scale=0, bf16, causal): "),
            std::string::npos)
      << bwd;
}

// What a host without a GPU can do with cuDNN 9.14 and frontend 1.15, found
// by trying: describe and serialise a graph (above), but not validate it (the
// SDPA support check reads the device's properties through the CUDA runtime),
// nor make a handle (cudnnCreate: CUDNN_STATUS_NOT_INITIALIZED), which
// build_operation_graph needs. Should a later frontend validate without a
// GPU, this fails, and the CPU tests can then prove more.
TEST(CudaSdpa, WithoutAGpuValidateIsWhereTheGraphStops) {
  std::string why;
  if (!cuda_devices(&why).empty()) GTEST_SKIP() << "a GPU is present: the graphs build (ValidatesAndBuilds...)";
  for (const auto& [model, shape] : kTrainingShapes) {
    SCOPED_TRACE(model);
    const SdpaLayout l = layout_of(shape);
    for (const auto& graph : {sdpa_forward_graph(l), sdpa_backward_graph(l)}) {
      cudnn_frontend::error_t e = graph->validate();
      EXPECT_FALSE(e.is_good());
      EXPECT_NE(e.get_message().find("cuda_get_device"), std::string::npos) << e.get_message();
    }
  }
  cudnnHandle_t handle = nullptr;
  EXPECT_EQ(cudnnCreate(&handle), CUDNN_STATUS_NOT_INITIALIZED);
}

TEST(CudaSdpa, ValidatesAndBuildsEveryTrainingShape) {
  SKIP_WITHOUT_GPU();
  for (const auto& [model, shape] : kTrainingShapes) {
    SCOPED_TRACE(model);
    const size_t fwd = sdpa_forward_workspace_bytes(shape), bwd = sdpa_backward_workspace_bytes(shape);
    std::printf("%s: cuDNN SDPA workspace forward %zu bytes, backward %zu bytes\n", model, fwd, bwd);
    // A second ask finds the cached graph (and so the same plan).
    EXPECT_EQ(sdpa_forward_workspace_bytes(shape), fwd);
    EXPECT_EQ(sdpa_backward_workspace_bytes(shape), bwd);
  }
}

// Host tensors of bf16 values: `bf16` for the GPU, the same values widened
// to f32 for the CPU attention.
struct Operand {
  std::vector<bf16> device;
  Tensor host;
};

Operand random_operand(Shape shape, std::mt19937& rng, const char* tag) {
  Operand o{{}, Tensor::empty(shape, DType::f32, MemCategory::workspace, tag)};
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  o.device.resize(static_cast<size_t>(o.host.numel()));
  for (size_t i = 0; i < o.device.size(); ++i) {
    o.device[i] = bf16(u(rng));
    o.host.data<float>()[i] = to_f32(o.device[i]);
  }
  return o;
}

// max over elements of |gpu − cpu|, and max |cpu|.
struct Deviation {
  double max_error = 0, max_reference = 0;
};
template <class T>
Deviation deviation(const std::vector<T>& gpu, const Tensor& cpu) {
  Deviation d;
  for (size_t i = 0; i < gpu.size(); ++i) {
    const double ref = cpu.data<float>()[i];
    d.max_error = std::max(d.max_error, std::abs(double(to_f32(gpu[i])) - ref));
    d.max_reference = std::max(d.max_reference, std::abs(ref));
  }
  return d;
}

struct DeviceBuffer {
  explicit DeviceBuffer(size_t bytes) {
    const cudaError_t e = cudaMalloc(&ptr, std::max<size_t>(bytes, 1));
    ANVIL_CHECK(e == cudaSuccess, "cudaMalloc(", bytes, "): ", cudaGetErrorString(e));
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void* ptr = nullptr;
};

// Odd T (tiles cut through the last rows) and grouped-query heads (G = 4 and
// G = 2 with the head dims Anvil trains with), inputs uniform in [−1, 1).
TEST(CudaSdpa, MatchesTheCpuAttentionForwardAndBackward) {
  SKIP_WITHOUT_GPU();
  const SdpaShape cases[] = {{2, 77, 8, 2, 64, 0}, {1, 301, 4, 2, 128, 0}, {3, 129, 4, 4, 16, 0.2f}};
  std::mt19937 rng(7);
  for (const SdpaShape& s : cases) {
    SCOPED_TRACE(::testing::Message() << "B=" << s.B << " T=" << s.T << " Hq=" << s.Hq << " Hkv=" << s.Hkv
                                      << " D=" << s.D << " scale=" << s.scale);
    const Operand q = random_operand({s.B, s.T, s.Hq, s.D}, rng, "q"),
                  k = random_operand({s.B, s.T, s.Hkv, s.D}, rng, "k"),
                  v = random_operand({s.B, s.T, s.Hkv, s.D}, rng, "v"),
                  dout = random_operand({s.B, s.T, s.Hq, s.D}, rng, "dout");
    Tensor out = Tensor::empty({s.B, s.T, s.Hq, s.D}, DType::f32, MemCategory::workspace, "out");
    Tensor lse = Tensor::empty({s.B, s.Hq, s.T}, DType::f32, MemCategory::workspace, "lse");
    attention_forward(q.host, k.host, v.host, out, lse, s.scale);
    Tensor dq = Tensor::empty(q.host.shape(), DType::f32, MemCategory::workspace, "dq");
    Tensor dk = Tensor::empty(k.host.shape(), DType::f32, MemCategory::workspace, "dk");
    Tensor dv = Tensor::empty(v.host.shape(), DType::f32, MemCategory::workspace, "dv");
    attention_backward(dout.host, q.host, k.host, v.host, out, lse, dq, dk, dv, s.scale);

    const anvil::testing::DeviceArray<bf16> q_d(q.device), k_d(k.device), v_d(v.device), dout_d(dout.device);
    const anvil::testing::DeviceArray<bf16> o_d(std::vector<bf16>(q.device.size())),
        dq_d(std::vector<bf16>(q.device.size())), dk_d(std::vector<bf16>(k.device.size())),
        dv_d(std::vector<bf16>(k.device.size()));
    const anvil::testing::DeviceArray<float> lse_d(std::vector<float>(static_cast<size_t>(lse.numel())));
    const size_t ws_bytes = std::max(sdpa_forward_workspace_bytes(s), sdpa_backward_workspace_bytes(s));
    const DeviceBuffer ws(ws_bytes);
    sdpa_forward_cuda(s, q_d.get(), k_d.get(), v_d.get(), o_d.get(), lse_d.get(), ws.ptr, ws_bytes, nullptr);
    sdpa_backward_cuda(s, dout_d.get(), q_d.get(), k_d.get(), v_d.get(), o_d.get(), lse_d.get(), dq_d.get(), dk_d.get(),
                       dv_d.get(), ws.ptr, ws_bytes, nullptr);

    // out is a convex combination of v's rows (|v| < 1): P rounded to bf16
    // before P·V (relative 2⁻⁹ per weight) moves it by at most 2⁻⁹, its own
    // rounding to bf16 by at most 2⁻⁹ more: 2⁻⁸ in all, f32 sums aside.
    const Deviation o_dev = deviation(o_d.download(), out);
    EXPECT_LE(o_dev.max_error, std::ldexp(1.0, -8) + 1e-5) << "out";
    // lse in f32 from f32 scores of the same bf16 inputs: f32 rounding only.
    const Deviation lse_dev = deviation(lse_d.download(), lse);
    EXPECT_LE(lse_dev.max_error, 1e-4 * (1.0 + lse_dev.max_reference)) << "lse";
    // Each gradient is a sum of products with one bf16-rounded factor (P or
    // dS, relative 2⁻⁹) and is rounded to bf16 itself (2⁻⁹): within 2⁻⁶ of
    // its largest element, allowing the sums' cancellation a factor of 4.
    const std::pair<const char*, Deviation> grads[] = {{"dq", deviation(dq_d.download(), dq)},
                                                       {"dk", deviation(dk_d.download(), dk)},
                                                       {"dv", deviation(dv_d.download(), dv)}};
    for (const auto& [name, d] : grads)
      EXPECT_LE(d.max_error, std::ldexp(1.0, -6) * d.max_reference) << name << " (max |cpu| " << d.max_reference << ")";
  }
}

}  // namespace
