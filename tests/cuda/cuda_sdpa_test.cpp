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
//
// Block-causal attention (documents) through cuDNN's ragged SDPA: on any
// host, its graphs declare q, k, v, o (dO, dQ, dK, dV) with the ragged
// layout's dims and strides and each with its ragged offset (q's, k's or the
// token-major stats'), the documents' lengths as the padding mask's, and the
// backward the tokens in all; its errors name the mask. With a GPU its
// results match the CPU's block-causal attention within the causal bounds.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
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
#include "../document_bounds.h"

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

SdpaLayout layout_of(const SdpaShape& s) {
  return sdpa_layout_of(s.B, s.T, s.Hq, s.Hkv, s.D, s.scale, s.docs_batch, s.docs_max_seq);
}

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

// Block-causal shapes: the 1B model's sequence of 8192 in a ragged batch of 16
// documents of at most 2048 tokens, and a small odd one with a given scale.
const TrainingShape kRaggedShapes[] = {
    {"llama3_1b, 16 documents of at most 2048", {1, 8192, 32, 8, 64, 0, 16, 2048}},
    {"odd, 8 documents of at most 128", {3, 200, 6, 3, 32, 0.3f, 8, 128}},
};

// A [n, 1, 1, 1] array of the documents' pack, as serialised.
void expect_pack_array(const json& graph, const char* name, SdpaUid uid, int64_t n, const char* type) {
  SCOPED_TRACE(name);
  ASSERT_TRUE(graph["tensors"].contains(name)) << graph["tensors"].dump();
  const json& t = graph["tensors"][name];
  EXPECT_EQ(t["dim"].get<std::vector<int64_t>>(), (std::vector<int64_t>{n, 1, 1, 1}));
  EXPECT_EQ(t["stride"].get<std::vector<int64_t>>(), (std::vector<int64_t>{1, 1, 1, 1}));
  EXPECT_EQ(t["data_type"], type);
  EXPECT_EQ(t["uid"], static_cast<int64_t>(uid));
  EXPECT_EQ(t["is_virtual"], false);
}

// The padding mask over the entries' lengths: its flag and both length
// arrays on the node's ports.
void expect_padding(const json& graph, const SdpaLayout& l) {
  const json& node = graph["nodes"][0];
  EXPECT_EQ(node["padding_mask"], true);
  EXPECT_EQ(node["inputs"].value("SEQ_LEN_Q", ""), "seq_len_q") << node["inputs"].dump();
  EXPECT_EQ(node["inputs"].value("SEQ_LEN_KV", ""), "seq_len_kv") << node["inputs"].dump();
  expect_pack_array(graph, "seq_len_q", SdpaUid::seq_len_q, l.b, "INT32");
  expect_pack_array(graph, "seq_len_kv", SdpaUid::seq_len_kv, l.b, "INT32");
}

// A tensor of the graph as declared. The ragged offsets are read here, not
// from the serialised graph: they are no node's port, and the frontend's
// tensor JSON (utils/serialize.h) does not name a tensor's ragged offset.
cudnn_frontend::graph::Tensor_attributes declared(const cudnn_frontend::graph::Graph& g, SdpaUid uid) {
  cudnn_frontend::graph::Tensor_attributes t;
  cudnn_frontend::error_t e = g.query_tensor_attributes_of_uid(static_cast<int64_t>(uid), t);
  EXPECT_TRUE(e.is_good()) << "uid " << static_cast<int64_t>(uid) << ": " << e.get_message();
  return t;
}

// The tensor of uid `tensor` is offset by the [b + 1, 1, 1, 1] i64 array `offset`.
void expect_ragged_offset(const cudnn_frontend::graph::Graph& g, SdpaUid tensor, SdpaUid offset,
                          const char* offset_name, const SdpaLayout& l) {
  SCOPED_TRACE(::testing::Message() << "uid " << static_cast<int64_t>(tensor) << " by " << offset_name);
  cudnn_frontend::graph::Tensor_attributes t = declared(g, tensor);
  const std::shared_ptr<cudnn_frontend::graph::Tensor_attributes> o = t.get_ragged_offset();
  ASSERT_NE(o, nullptr) << "no ragged offset";
  EXPECT_EQ(o->get_uid(), static_cast<int64_t>(offset));
  EXPECT_EQ(o->get_name(), offset_name);
  EXPECT_EQ(o->get_dim(), (std::vector<int64_t>{l.b + 1, 1, 1, 1}));
  EXPECT_EQ(o->get_stride(), (std::vector<int64_t>{1, 1, 1, 1}));
  EXPECT_TRUE(o->get_data_type() == cudnn_frontend::DataType_t::INT64);
  EXPECT_FALSE(o->get_is_virtual());
}

// The serialised tensors are the node's ports: q, k, v, o, stats and the two
// length arrays (the three offset arrays hang off the tensors, see declared).
TEST(CudaSdpa, RaggedForwardGraphDeclaresTheDocumentsLayout) {
  for (const auto& [what, shape] : kRaggedShapes) {
    SCOPED_TRACE(what);
    const SdpaLayout l = layout_of(shape);
    ASSERT_TRUE(l.ragged);
    const auto graph = sdpa_forward_graph(l);
    const json g = serialised(*graph);
    expect_node(g, "SDPA_FWD", l);
    EXPECT_EQ(g["nodes"][0]["generate_stats"], true);
    expect_padding(g, l);
    expect_tensor(g, "q", SdpaUid::q, l.q, "BFLOAT16");
    expect_tensor(g, "k", SdpaUid::k, l.k, "BFLOAT16");
    expect_tensor(g, "v", SdpaUid::v, l.v, "BFLOAT16");
    expect_tensor(g, "o", SdpaUid::o, l.o, "BFLOAT16");
    expect_tensor(g, "stats", SdpaUid::stats, l.stats, "FLOAT");
    // Token-major: a step in the heads is 1, in the tokens Hq.
    EXPECT_EQ(l.stats.stride, (std::array<int64_t, 4>{l.h_q * l.s_q, 1, l.h_q, 1}));
    EXPECT_EQ(g["tensors"].size(), 7u) << g["tensors"].dump();
    for (const SdpaUid t : {SdpaUid::q, SdpaUid::o})
      expect_ragged_offset(*graph, t, SdpaUid::q_offset, "q_offset", l);
    for (const SdpaUid t : {SdpaUid::k, SdpaUid::v})
      expect_ragged_offset(*graph, t, SdpaUid::kv_offset, "kv_offset", l);
    expect_ragged_offset(*graph, SdpaUid::stats, SdpaUid::stats_offset, "stats_offset", l);
  }
}

TEST(CudaSdpa, RaggedBackwardGraphDeclaresTheDocumentsLayoutAndTheTokensInAll) {
  for (const auto& [what, shape] : kRaggedShapes) {
    SCOPED_TRACE(what);
    const SdpaLayout l = layout_of(shape);
    const auto graph = sdpa_backward_graph(l);
    const json g = serialised(*graph);
    expect_node(g, "SDPA_BWD", l);
    expect_padding(g, l);
    EXPECT_EQ(g["nodes"][0]["max_total_seq_len_q"], shape.B * shape.T);
    EXPECT_EQ(g["nodes"][0]["max_total_seq_len_kv"], shape.B * shape.T);
    expect_tensor(g, "q", SdpaUid::q, l.q, "BFLOAT16");
    expect_tensor(g, "k", SdpaUid::k, l.k, "BFLOAT16");
    expect_tensor(g, "v", SdpaUid::v, l.v, "BFLOAT16");
    expect_tensor(g, "o", SdpaUid::o, l.o, "BFLOAT16");
    expect_tensor(g, "dO", SdpaUid::d_o, l.o, "BFLOAT16");
    expect_tensor(g, "stats", SdpaUid::stats, l.stats, "FLOAT");
    expect_tensor(g, "dQ", SdpaUid::dq, l.q, "BFLOAT16");
    expect_tensor(g, "dK", SdpaUid::dk, l.k, "BFLOAT16");
    expect_tensor(g, "dV", SdpaUid::dv, l.v, "BFLOAT16");
    EXPECT_EQ(g["tensors"].size(), 11u) << g["tensors"].dump();
    for (const SdpaUid t : {SdpaUid::q, SdpaUid::o, SdpaUid::d_o, SdpaUid::dq})
      expect_ragged_offset(*graph, t, SdpaUid::q_offset, "q_offset", l);
    for (const SdpaUid t : {SdpaUid::k, SdpaUid::v, SdpaUid::dk, SdpaUid::dv})
      expect_ragged_offset(*graph, t, SdpaUid::kv_offset, "kv_offset", l);
    expect_ragged_offset(*graph, SdpaUid::stats, SdpaUid::stats_offset, "stats_offset", l);
  }
}

// The same shapes without documents: no padding mask, no offsets, no
// tokens in all (so the checks above see what documents add).
TEST(CudaSdpa, CausalGraphsHaveNoPaddingNorRaggedOffsets) {
  for (const auto& [what, ragged] : kRaggedShapes) {
    SCOPED_TRACE(what);
    const SdpaLayout l = layout_of({ragged.B, ragged.T, ragged.Hq, ragged.Hkv, ragged.D, ragged.scale});
    ASSERT_FALSE(l.ragged);
    const auto fwd = sdpa_forward_graph(l), bwd = sdpa_backward_graph(l);
    const json f = serialised(*fwd), b = serialised(*bwd);
    EXPECT_EQ(f["nodes"][0]["padding_mask"], false);
    EXPECT_EQ(b["nodes"][0]["padding_mask"], false);
    EXPECT_TRUE(b["nodes"][0]["max_total_seq_len_q"].is_null());
    EXPECT_TRUE(b["nodes"][0]["max_total_seq_len_kv"].is_null());
    EXPECT_EQ(declared(*fwd, SdpaUid::q).get_ragged_offset(), nullptr);
    EXPECT_EQ(declared(*bwd, SdpaUid::dk).get_ragged_offset(), nullptr);
  }
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

// The same with documents: the message names the ragged batch and length.
TEST(CudaSdpa, RaggedErrorsNameTheMask) {
  const SdpaShape s{2, 64, 4, 2, 512, 0, 4, 64};
  const std::string mask = "bf16, block-causal: ragged, 4 documents of at most 64): ";
  const std::string fwd = error_of([&] { (void)sdpa_forward_workspace_bytes(s); });
  EXPECT_NE(fwd.find("cuDNN SDPA forward graph (B=2 T=64 Hq=4 Hkv=2 D=512 scale=0, " + mask), std::string::npos)
      << fwd;
  EXPECT_NE(fwd.find(" failed: "), std::string::npos) << fwd;
  const std::string bwd = error_of([&] { (void)sdpa_backward_workspace_bytes(s); });
  EXPECT_NE(bwd.find("cuDNN SDPA backward graph (B=2 T=64 Hq=4 Hkv=2 D=512 scale=0, " + mask), std::string::npos)
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

// max over elements of |gpu − cpu|, and max |cpu|. A NaN error (an element
// never written, or a NaN computed) is infinite, so no bound passes it.
struct Deviation {
  double max_error = 0, max_reference = 0;
};
template <class T>
Deviation deviation(const std::vector<T>& gpu, const Tensor& cpu) {
  Deviation d;
  EXPECT_EQ(static_cast<int64_t>(gpu.size()), cpu.numel());
  for (size_t i = 0; i < gpu.size(); ++i) {
    const double ref = cpu.data<float>()[i], error = std::abs(double(to_f32(gpu[i])) - ref);
    d.max_error = std::isnan(error) ? INFINITY : std::max(d.max_error, error);
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

// The CPU attention (ops/attention.h), f32 on the bf16 inputs' values,
// forward and backward, over `window` (its documents, or causal).
struct CpuAttention {
  Tensor out, lse, dq, dk, dv;
};
CpuAttention cpu_attention(const SdpaShape& s, const Operand& q, const Operand& k, const Operand& v,
                           const Operand& dout, const AttentionWindow& window = {}) {
  CpuAttention c;
  c.out = Tensor::empty({s.B, s.T, s.Hq, s.D}, DType::f32, MemCategory::workspace, "out");
  c.lse = Tensor::empty({s.B, s.Hq, s.T}, DType::f32, MemCategory::workspace, "lse");
  attention_forward(q.host, k.host, v.host, c.out, c.lse, s.scale, {}, window);
  c.dq = Tensor::empty(q.host.shape(), DType::f32, MemCategory::workspace, "dq");
  c.dk = Tensor::empty(k.host.shape(), DType::f32, MemCategory::workspace, "dk");
  c.dv = Tensor::empty(v.host.shape(), DType::f32, MemCategory::workspace, "dv");
  attention_backward(dout.host, q.host, k.host, v.host, c.out, c.lse, c.dq, c.dk, c.dv, s.scale, {}, window);
  return c;
}

// The GPU's results, read back; lse (B, Hq, T).
struct GpuAttention {
  std::vector<bf16> out, dq, dk, dv;
  std::vector<float> lse;
};

void expect_near_the_cpu(const GpuAttention& gpu, const CpuAttention& cpu) {
  // out is a convex combination of v's rows (|v| < 1): P rounded to bf16
  // before P·V (relative 2⁻⁹ per weight) moves it by at most 2⁻⁹, its own
  // rounding to bf16 by at most 2⁻⁹ more: 2⁻⁸ in all, f32 sums aside.
  const Deviation o_dev = deviation(gpu.out, cpu.out);
  EXPECT_LE(o_dev.max_error, std::ldexp(1.0, -8) + 1e-5) << "out";
  // lse in f32 from f32 scores of the same bf16 inputs: f32 rounding only.
  const Deviation lse_dev = deviation(gpu.lse, cpu.lse);
  EXPECT_LE(lse_dev.max_error, 1e-4 * (1.0 + lse_dev.max_reference)) << "lse";
  // Each gradient is a sum of products with one bf16-rounded factor (P or
  // dS, relative 2⁻⁹) and is rounded to bf16 itself (2⁻⁹): within 2⁻⁶ of
  // its largest element, allowing the sums' cancellation a factor of 4.
  const std::pair<const char*, Deviation> grads[] = {{"dq", deviation(gpu.dq, cpu.dq)},
                                                     {"dk", deviation(gpu.dk, cpu.dk)},
                                                     {"dv", deviation(gpu.dv, cpu.dv)}};
  for (const auto& [name, d] : grads)
    EXPECT_LE(d.max_error, std::ldexp(1.0, -6) * d.max_reference) << name << " (max |cpu| " << d.max_reference << ")";
}

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
    const CpuAttention cpu = cpu_attention(s, q, k, v, dout);

    const anvil::testing::DeviceArray<bf16> q_d(q.device), k_d(k.device), v_d(v.device), dout_d(dout.device);
    const anvil::testing::DeviceArray<bf16> o_d(std::vector<bf16>(q.device.size())),
        dq_d(std::vector<bf16>(q.device.size())), dk_d(std::vector<bf16>(k.device.size())),
        dv_d(std::vector<bf16>(k.device.size()));
    const anvil::testing::DeviceArray<float> lse_d(std::vector<float>(static_cast<size_t>(cpu.lse.numel())));
    const size_t ws_bytes = std::max(sdpa_forward_workspace_bytes(s), sdpa_backward_workspace_bytes(s));
    const DeviceBuffer ws(ws_bytes);
    sdpa_forward_cuda(s, q_d.get(), k_d.get(), v_d.get(), o_d.get(), lse_d.get(), nullptr, ws.ptr, ws_bytes, nullptr);
    sdpa_backward_cuda(s, dout_d.get(), q_d.get(), k_d.get(), v_d.get(), o_d.get(), lse_d.get(), nullptr, dq_d.get(),
                       dk_d.get(), dv_d.get(), ws.ptr, ws_bytes, nullptr);
    expect_near_the_cpu({o_d.download(), dq_d.download(), dk_d.download(), dv_d.download(), lse_d.download()}, cpu);
  }
}

// Block-causal attention through cuDNN's ragged SDPA against the CPU's over
// the same documents, within the causal bounds (each query row is a causal
// row over its document's keys, its sums no longer). Odd T, several
// documents per sequence (one of a single token, one past a power of two)
// beside a whole sequence, grouped-query heads.
TEST(CudaSdpa, RaggedMatchesTheCpuBlockCausalAttention) {
  SKIP_WITHOUT_GPU();
  struct Case {
    SdpaShape shape;
    std::vector<std::vector<int32_t>> lengths;
  };
  const Case cases[] = {{{2, 77, 8, 2, 64, 0}, {{20, 1, 56}, {77}}}, {{1, 301, 4, 2, 128, 0}, {{100, 150, 51}}}};
  std::mt19937 rng(11);
  for (const Case& c : cases) {
    SdpaShape s = c.shape;
    SCOPED_TRACE(::testing::Message() << "B=" << s.B << " T=" << s.T << " Hq=" << s.Hq << " Hkv=" << s.Hkv
                                      << " D=" << s.D << " scale=" << s.scale);
    const Tensor documents = anvil::testing::document_bounds(c.lengths, s.T);
    const Operand q = random_operand({s.B, s.T, s.Hq, s.D}, rng, "q"),
                  k = random_operand({s.B, s.T, s.Hkv, s.D}, rng, "k"),
                  v = random_operand({s.B, s.T, s.Hkv, s.D}, rng, "v"),
                  dout = random_operand({s.B, s.T, s.Hq, s.D}, rng, "dout");
    const CpuAttention cpu = cpu_attention(s, q, k, v, dout, AttentionWindow{0, 0, documents});

    // The documents' ragged batch picks the graph; their pack goes to the device.
    const SdpaDocuments docs = sdpa_documents_of(documents.data<int32_t>(), s.B, s.T, s.T);
    s.docs_batch = docs.batch;
    s.docs_max_seq = docs.max_seq;
    const anvil::testing::DeviceArray<std::byte> pack_d(
        sdpa_documents_packed(docs, layout_of(s), sdpa_documents_capacity(s.B, s.T)));

    // Outputs NaN until written, so a token no document entry covers fails the bounds.
    const anvil::testing::DeviceArray<bf16> q_d(q.device), k_d(k.device), v_d(v.device), dout_d(dout.device);
    const anvil::testing::DeviceArray<bf16> o_d(std::vector<bf16>(q.device.size(), bf16(NAN))),
        dq_d(std::vector<bf16>(q.device.size(), bf16(NAN))), dk_d(std::vector<bf16>(k.device.size(), bf16(NAN))),
        dv_d(std::vector<bf16>(k.device.size(), bf16(NAN)));
    // Token-major (B·T, Hq) statistics.
    const anvil::testing::DeviceArray<float> stats_d(std::vector<float>(static_cast<size_t>(s.B * s.T * s.Hq), NAN));
    const size_t ws_bytes = std::max(sdpa_forward_workspace_bytes(s), sdpa_backward_workspace_bytes(s));
    const DeviceBuffer ws(ws_bytes);
    sdpa_forward_cuda(s, q_d.get(), k_d.get(), v_d.get(), o_d.get(), stats_d.get(), pack_d.get(), ws.ptr, ws_bytes,
                      nullptr);
    sdpa_backward_cuda(s, dout_d.get(), q_d.get(), k_d.get(), v_d.get(), o_d.get(), stats_d.get(), pack_d.get(),
                       dq_d.get(), dk_d.get(), dv_d.get(), ws.ptr, ws_bytes, nullptr);

    // The stats as the CPU's lse (B, Hq, T).
    const std::vector<float> stats = stats_d.download();
    std::vector<float> lse(stats.size());
    for (int64_t b = 0; b < s.B; ++b)
      for (int64_t h = 0; h < s.Hq; ++h)
        for (int64_t t = 0; t < s.T; ++t) lse[(b * s.Hq + h) * s.T + t] = stats[(b * s.T + t) * s.Hq + h];
    expect_near_the_cpu({o_d.download(), dq_d.download(), dk_d.download(), dv_d.download(), lse}, cpu);
  }
}

}  // namespace
