#include "anvil/ops/cuda/sdpa.h"

#include <cudnn.h>

#include <array>
#include <bit>
#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "anvil/core/error.h"
#include "anvil/ops/cuda/sdpa_graph.h"
#include "anvil/ops/sdpa_layout.h"

namespace anvil {

namespace {

namespace fe = cudnn_frontend;

enum class Direction : int64_t { forward, backward };

std::string graph_text(Direction d, const SdpaShape& s) {
  const std::string mask = s.docs_batch == 0 ? "causal"
                                             : detail::concat("block-causal: ragged, ", s.docs_batch,
                                                              " documents of at most ", s.docs_max_seq);
  return detail::concat("cuDNN SDPA ", d == Direction::forward ? "forward" : "backward", " graph (B=", s.B, " T=", s.T,
                        " Hq=", s.Hq, " Hkv=", s.Hkv, " D=", s.D, " scale=", s.scale, ", bf16, ", mask, ")");
}

// By value: the frontend's get_message() is not const.
void check(fe::error_t e, const char* step, Direction d, const SdpaShape& s) {
  ANVIL_CHECK(e.is_good(), graph_text(d, s), ": ", step, " failed: ", e.get_message());
}

void check(cudnnStatus_t status, const char* call, Direction d, const SdpaShape& s) {
  ANVIL_CHECK(status == CUDNN_STATUS_SUCCESS, graph_text(d, s), ": ", call, " failed: ", cudnnGetErrorString(status));
}

// The handle of `device`, made on first use. A handle belongs to the GPU that
// was current when it was made; never destroyed (see sdpa.h).
cudnnHandle_t handle_for(int device, Direction d, const SdpaShape& s) {
  static std::mutex mutex;
  static std::map<int, cudnnHandle_t> handles;
  const std::lock_guard lock(mutex);
  cudnnHandle_t& h = handles[device];
  if (!h) {
    cudnnHandle_t made = nullptr;
    check(cudnnCreate(&made), "cudnnCreate", d, s);
    h = made;
  }
  return h;
}

struct Plan {
  std::shared_ptr<fe::graph::Graph> graph;
  cudnnHandle_t handle = nullptr;
  int64_t workspace_bytes = 0;
};

// The graph's steps one at a time (rather than Graph::build), so an error
// names the one that failed. validate() needs the GPU's properties but no
// handle, so it runs before the handle is made.
std::unique_ptr<Plan> build(Direction d, const SdpaShape& s, int device) {
  const SdpaLayout layout = sdpa_layout_of(s.B, s.T, s.Hq, s.Hkv, s.D, s.scale, s.docs_batch, s.docs_max_seq);
  auto plan = std::make_unique<Plan>();
  plan->graph = d == Direction::forward ? sdpa_forward_graph(layout) : sdpa_backward_graph(layout);
  fe::graph::Graph& g = *plan->graph;
  check(g.validate(), "validate", d, s);
  plan->handle = handle_for(device, d, s);
  check(g.build_operation_graph(plan->handle), "build_operation_graph", d, s);
  check(g.create_execution_plans({fe::HeurMode_t::A}), "create_execution_plans", d, s);
  check(g.check_support(), "check_support", d, s);
  check(g.build_plans(fe::BuildPlanPolicy_t::HEURISTICS_CHOICE), "build_plans", d, s);
  check(g.get_workspace_size(plan->workspace_bytes), "get_workspace_size", d, s);
  return plan;
}

// Plans by signature, for the process's life. Built under the lock: a
// signature's concurrent first uses build it once, and builds are few (one
// per attention shape of a run). Map nodes stay put, so a plan found is used
// unlocked.
const Plan& plan_for(Direction d, const SdpaShape& s) {
  int device = 0;
  const cudaError_t err = cudaGetDevice(&device);
  ANVIL_CHECK(err == cudaSuccess, graph_text(d, s), ": cudaGetDevice failed: ", cudaGetErrorString(err));
  using Signature = std::array<int64_t, 10>;
  const Signature key = {device, static_cast<int64_t>(d), s.B,           s.T,           s.Hq, s.Hkv, s.D,
                         std::bit_cast<int32_t>(s.scale), s.docs_batch, s.docs_max_seq};
  static std::mutex mutex;
  static std::map<Signature, std::unique_ptr<Plan>> plans;
  const std::lock_guard lock(mutex);
  std::unique_ptr<Plan>& plan = plans[key];
  if (!plan) plan = build(d, s, device);
  return *plan;
}

// cuDNN's variant pack takes void* for inputs too; it only reads them.
using VariantPack = std::unordered_map<fe::graph::Tensor_attributes::uid_t, void*>;
void bind(VariantPack& pack, SdpaUid uid, const void* ptr) { pack[static_cast<int64_t>(uid)] = const_cast<void*>(ptr); }

// The documents' arrays, from their device pack (ops/sdpa_layout.h), sized
// for the shape's capacity.
void bind_documents(VariantPack& pack, const SdpaShape& s, const void* documents, Direction d) {
  if (s.docs_batch == 0) return;
  ANVIL_CHECK(documents != nullptr, graph_text(d, s), ": no documents given");
  const SdpaDocumentsPack at = sdpa_documents_pack_of(sdpa_documents_capacity(s.B, s.T));
  const auto* base = static_cast<const std::byte*>(documents);
  bind(pack, SdpaUid::seq_len_q, base + at.seq_len);
  bind(pack, SdpaUid::seq_len_kv, base + at.seq_len);
  bind(pack, SdpaUid::q_offset, base + at.q_offset);
  bind(pack, SdpaUid::kv_offset, base + at.kv_offset);
  bind(pack, SdpaUid::stats_offset, base + at.stats_offset);
}

void run(Direction d, const SdpaShape& s, VariantPack& pack, void* workspace, size_t workspace_bytes,
         cudaStream_t stream) {
  const Plan& plan = plan_for(d, s);
  ANVIL_CHECK(workspace_bytes >= static_cast<size_t>(plan.workspace_bytes), graph_text(d, s), ": needs ",
              plan.workspace_bytes, " bytes of workspace, was given ", workspace_bytes);
  // The stream is the handle's: set and used under one lock.
  static std::mutex mutex;
  const std::lock_guard lock(mutex);
  check(cudnnSetStream(plan.handle, stream), "cudnnSetStream", d, s);
  check(plan.graph->execute(plan.handle, pack, workspace), "execute", d, s);
}

}  // namespace

size_t sdpa_forward_workspace_bytes(const SdpaShape& shape) {
  return static_cast<size_t>(plan_for(Direction::forward, shape).workspace_bytes);
}

size_t sdpa_backward_workspace_bytes(const SdpaShape& shape) {
  return static_cast<size_t>(plan_for(Direction::backward, shape).workspace_bytes);
}

void sdpa_forward_cuda(const SdpaShape& shape, const void* q, const void* k, const void* v, void* out, float* stats,
                       const void* documents, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  VariantPack pack;
  bind(pack, SdpaUid::q, q);
  bind(pack, SdpaUid::k, k);
  bind(pack, SdpaUid::v, v);
  bind(pack, SdpaUid::o, out);
  bind(pack, SdpaUid::stats, stats);
  bind_documents(pack, shape, documents, Direction::forward);
  run(Direction::forward, shape, pack, workspace, workspace_bytes, stream);
}

void sdpa_backward_cuda(const SdpaShape& shape, const void* dout, const void* q, const void* k, const void* v,
                        const void* out, const float* stats, const void* documents, void* dq, void* dk, void* dv,
                        void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  VariantPack pack;
  bind(pack, SdpaUid::q, q);
  bind(pack, SdpaUid::k, k);
  bind(pack, SdpaUid::v, v);
  bind(pack, SdpaUid::o, out);
  bind(pack, SdpaUid::d_o, dout);
  bind(pack, SdpaUid::stats, stats);
  bind_documents(pack, shape, documents, Direction::backward);
  bind(pack, SdpaUid::dq, dq);
  bind(pack, SdpaUid::dk, dk);
  bind(pack, SdpaUid::dv, dv);
  run(Direction::backward, shape, pack, workspace, workspace_bytes, stream);
}

}  // namespace anvil
