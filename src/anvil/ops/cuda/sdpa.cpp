#include "anvil/ops/cuda/sdpa.h"

#include <cudnn.h>

#include <array>
#include <bit>
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
  return detail::concat("cuDNN SDPA ", d == Direction::forward ? "forward" : "backward", " graph (B=", s.B, " T=", s.T,
                        " Hq=", s.Hq, " Hkv=", s.Hkv, " D=", s.D, " scale=", s.scale, ", bf16, causal)");
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
  const SdpaLayout layout = sdpa_layout_of(s.B, s.T, s.Hq, s.Hkv, s.D, s.scale);
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
  using Signature = std::array<int64_t, 8>;
  const Signature key = {device, static_cast<int64_t>(d), s.B, s.T, s.Hq, s.Hkv, s.D, std::bit_cast<int32_t>(s.scale)};
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

void sdpa_forward_cuda(const SdpaShape& shape, const void* q, const void* k, const void* v, void* out, float* lse,
                       void* workspace, size_t workspace_bytes, cudaStream_t stream) {
  VariantPack pack;
  bind(pack, SdpaUid::q, q);
  bind(pack, SdpaUid::k, k);
  bind(pack, SdpaUid::v, v);
  bind(pack, SdpaUid::o, out);
  bind(pack, SdpaUid::stats, lse);
  run(Direction::forward, shape, pack, workspace, workspace_bytes, stream);
}

void sdpa_backward_cuda(const SdpaShape& shape, const void* dout, const void* q, const void* k, const void* v,
                        const void* out, const float* lse, void* dq, void* dk, void* dv, void* workspace,
                        size_t workspace_bytes, cudaStream_t stream) {
  VariantPack pack;
  bind(pack, SdpaUid::q, q);
  bind(pack, SdpaUid::k, k);
  bind(pack, SdpaUid::v, v);
  bind(pack, SdpaUid::o, out);
  bind(pack, SdpaUid::d_o, dout);
  bind(pack, SdpaUid::stats, lse);
  bind(pack, SdpaUid::dq, dq);
  bind(pack, SdpaUid::dk, dk);
  bind(pack, SdpaUid::dv, dv);
  run(Direction::backward, shape, pack, workspace, workspace_bytes, stream);
}

}  // namespace anvil
