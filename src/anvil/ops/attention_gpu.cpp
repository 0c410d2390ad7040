#include "anvil/ops/attention_gpu.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <vector>

#include "anvil/core/dry_run.h"
#include "anvil/core/error.h"
#include "anvil/ops/sdpa_layout.h"

namespace anvil {

namespace {

SdpaShape shape_of(const Tensor& q, const Tensor& k, float scale, const AttentionWindow& window,
                   AttentionAccumulate accumulate, const char* what) {
  ANVIL_ASSERT(q.size(0) == k.size(0) && q.size(3) == k.size(3), what, ": q ", shape_str(q.shape()), " k ",
               shape_str(k.shape()));
  if (const Tensor& docs = window.documents; docs.defined())
    ANVIL_ASSERT(docs.device().is_cpu() && docs.dtype() == DType::i32 && docs.ndim() == 3 &&
                     docs.size(0) == q.size(0) && docs.size(1) == 2 && docs.size(2) >= q.size(1),
                 what, ": documents ", shape_str(docs.shape()), " ", dtype_name(docs.dtype()), " on ",
                 docs.device().str(), " for q ", shape_str(q.shape()),
                 " (the GPU's attention reads them on the host: (B, 2, S ≥ T) i32)");
  ANVIL_CHECK(window.q_first == 0 && window.k_first == 0 && q.size(1) == k.size(1),
              what, ": a GPU attends whole sequences only (no context parallelism on a GPU yet)");
  ANVIL_CHECK(!accumulate.dq && !accumulate.dkv, what, ": a GPU writes the gradients, it does not accumulate them");
  SdpaShape s{q.size(0), q.size(1), q.size(2), k.size(2), q.size(3), scale};
  ANVIL_CHECK(s.Hkv > 0 && s.Hq % s.Hkv == 0, what, ": ", s.Hq, " query heads cannot be shared evenly by ", s.Hkv,
              " key/value heads");
  if (s.scale == 0.0f) s.scale = 1.0f / std::sqrt(static_cast<float>(s.D));
  return s;
}

// cuDNN's workspace for a call: the planned bytes, or the graph's where it asks more.
Tensor sdpa_workspace(bool backward, const SdpaShape& s, Device device) {
  size_t bytes = sdpa_planned_workspace_bytes(backward, s);
  if (!dry_run()) {
    const size_t asked = gpu_kernels("attention").sdpa_workspace_bytes(backward, s);
    static std::atomic<bool> said{false};
    if (asked > bytes && !said.exchange(true))
      std::fprintf(stderr,
                   "anvil: cuDNN's SDPA %s asks %zu bytes of workspace where the dry run planned %zu; the memory "
                   "estimate is short by the difference\n",
                   backward ? "backward" : "forward", asked, bytes);
    bytes = std::max(bytes, asked);
  }
  return Tensor::empty({static_cast<int64_t>((bytes + 3) / 4)}, DType::f32, MemCategory::workspace,
                       backward ? "sdpa.backward_workspace" : "sdpa.forward_workspace", device);
}

// Block-causal attention's documents where cuDNN reads them: their pack
// (ops/sdpa_layout.h) copied to the device, sized by the shape's capacity so
// that a dry run, which has no documents to read, allocates the same bytes;
// and the token-major stats cuDNN's ragged SDPA takes in place of the lse.
// Sets the shape's ragged batch and length (a real run only).
struct DeviceDocuments {
  Tensor pack, stats;
};
DeviceDocuments documents_on_device(SdpaShape& s, const Tensor& documents, Device device) {
  const int64_t capacity = sdpa_documents_capacity(s.B, s.T);
  const SdpaDocumentsPack at = sdpa_documents_pack_of(capacity);
  const Tensor host = Tensor::empty({static_cast<int64_t>(at.bytes / 4)}, DType::i32, MemCategory::workspace,
                                    "sdpa.documents", Device::cpu());
  if (!dry_run()) {
    const SdpaDocuments docs = sdpa_documents_of(documents.data<int32_t>(), s.B, s.T, documents.size(2));
    s.docs_batch = docs.batch;
    s.docs_max_seq = docs.max_seq;
    const std::vector<std::byte> bytes = sdpa_documents_packed(
        docs, sdpa_layout_of(s.B, s.T, s.Hq, s.Hkv, s.D, s.scale, docs.batch, docs.max_seq), capacity);
    std::memcpy(host.raw(), bytes.data(), bytes.size());
  }
  return {host.to(device, MemCategory::workspace, "sdpa.documents"),
          Tensor::empty({s.B, s.T, s.Hq}, DType::f32, MemCategory::workspace, "sdpa.stats_token_major", device)};
}

// The fp32 attention's first key per score row (b, h, t): the start of the
// document holding t, on the device; undefined without documents.
Tensor first_keys_on_device(const SdpaShape& s, const Tensor& documents, Device device) {
  if (!documents.defined()) return {};
  const Tensor host =
      Tensor::empty({s.B * s.Hq * s.T}, DType::i32, MemCategory::workspace, "attention.first_key", Device::cpu());
  if (!dry_run()) {
    const int32_t* starts = documents.data<int32_t>();
    const int64_t S = documents.size(2);
    int32_t* first = host.data<int32_t>();
    for (int64_t b = 0; b < s.B; ++b)
      for (int64_t h = 0; h < s.Hq; ++h)
        for (int64_t t = 0; t < s.T; ++t) first[(b * s.Hq + h) * s.T + t] = starts[b * 2 * S + t];
  }
  return host.to(device, MemCategory::workspace, "attention.first_key");
}

const int32_t* i32(const Tensor& t) { return t.defined() ? static_cast<const int32_t*>(t.raw()) : nullptr; }

// The fp32 attention's products, one per query head, batched over the
// sequences. Head h reads kv head h / group; rows are strided by the heads.
struct HeadProducts {
  const SdpaShape& s;
  Device device;
  int64_t q_row() const { return s.Hq * s.D; }   // q, out, dout, dq row stride
  int64_t kv_row() const { return s.Hkv * s.D; }  // k, v, dk, dv row stride
  int64_t square() const { return s.T * s.T; }
  // scores (B, Hq, T, T): head h's (T, T) block of sequence b at (b·Hq + h)·T².
  GemmBatch batch(int64_t stride_a, int64_t stride_b, int64_t stride_c) const {
    return {s.B, stride_a, stride_b, stride_c};
  }
  void run(const GemmShape& g, const void* A, const void* B, void* C, const GemmBatch& batch) const {
    gpu_gemm(device, g, A, B, C, batch);
  }
};

const float* f32(const Tensor& t) { return static_cast<const float*>(t.raw()); }
float* f32w(const Tensor& t) { return static_cast<float*>(t.raw()); }

// S_bh = Q_bh·K_bgᵀ into scores, for every head.
void scores_of(const HeadProducts& p, const float* q, const float* k, float* scores) {
  const SdpaShape& s = p.s;
  const int64_t group = s.Hq / s.Hkv;
  for (int64_t h = 0; h < s.Hq; ++h) {
    const GemmShape g{.M = s.T, .N = s.T, .K = s.D, .trans_b = true, .lda = p.q_row(), .ldb = p.kv_row(),
                      .ldc = s.T};
    p.run(g, q + h * s.D, k + (h / group) * s.D, scores + h * p.square(),
          p.batch(s.T * p.q_row(), s.T * p.kv_row(), s.Hq * p.square()));
  }
}

void forward_f32(const SdpaShape& s, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
                 const Tensor& documents) {
  const HeadProducts p{s, q.device()};
  const Tensor first_key = first_keys_on_device(s, documents, q.device());
  const Tensor probs = Tensor::empty({s.B, s.Hq, s.T, s.T}, DType::f32, MemCategory::workspace,
                                     "attention.probs", q.device());
  scores_of(p, f32(q), f32(k), f32w(probs));
  if (!dry_run())
    gpu_kernels("attention.forward")
        .attention_softmax_forward(f32(probs), f32w(probs), f32w(lse), s.B * s.Hq * s.T, s.T, s.scale, i32(first_key));
  const int64_t group = s.Hq / s.Hkv;
  for (int64_t h = 0; h < s.Hq; ++h) {  // O_bh = P_bh·V_bg
    const GemmShape g{.M = s.T, .N = s.D, .K = s.T, .lda = s.T, .ldb = p.kv_row(), .ldc = p.q_row()};
    p.run(g, f32(probs) + h * p.square(), f32(v) + (h / group) * s.D, f32w(out) + h * s.D,
          p.batch(s.Hq * p.square(), s.T * p.kv_row(), s.T * p.q_row()));
  }
}

void backward_f32(const SdpaShape& s, const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                  const Tensor& dq, const Tensor& dk, const Tensor& dv, const Tensor& documents) {
  const HeadProducts p{s, q.device()};
  const Tensor first_key = first_keys_on_device(s, documents, q.device());
  const Tensor probs = Tensor::empty({s.B, s.Hq, s.T, s.T}, DType::f32, MemCategory::workspace,
                                     "attention.probs", q.device());
  const Tensor dprobs = Tensor::empty({s.B, s.Hq, s.T, s.T}, DType::f32, MemCategory::workspace,
                                      "attention.dprobs", q.device());
  const Tensor lse = Tensor::empty({s.B, s.Hq, s.T}, DType::f32, MemCategory::workspace, "attention.lse_again",
                                   q.device());
  scores_of(p, f32(q), f32(k), f32w(probs));  // P again, as the forward made it (the same bits)
  if (!dry_run())
    gpu_kernels("attention.backward")
        .attention_softmax_forward(f32(probs), f32w(probs), f32w(lse), s.B * s.Hq * s.T, s.T, s.scale, i32(first_key));
  const int64_t group = s.Hq / s.Hkv;
  for (int64_t h = 0; h < s.Hq; ++h) {  // dP_bh = dO_bh·V_bgᵀ
    const GemmShape g{.M = s.T, .N = s.T, .K = s.D, .trans_b = true, .lda = p.q_row(), .ldb = p.kv_row(),
                      .ldc = s.T};
    p.run(g, f32(dout) + h * s.D, f32(v) + (h / group) * s.D, f32w(dprobs) + h * p.square(),
          p.batch(s.T * p.q_row(), s.T * p.kv_row(), s.Hq * p.square()));
  }
  if (!dry_run())  // dS in place of dP
    gpu_kernels("attention.backward")
        .attention_softmax_backward(f32(probs), f32(dprobs), f32w(dprobs), s.B * s.Hq * s.T, s.T, s.scale,
                                    i32(first_key));
  for (int64_t h = 0; h < s.Hq; ++h) {
    const int64_t kv = (h / group) * s.D;
    const bool first_of_group = h % group == 0;  // the group's first head writes dK and dV, the others add
    // dQ_bh = dS_bh·K_bg
    const GemmShape gq{.M = s.T, .N = s.D, .K = s.T, .lda = s.T, .ldb = p.kv_row(), .ldc = p.q_row()};
    p.run(gq, f32(dprobs) + h * p.square(), f32(k) + kv, f32w(dq) + h * s.D,
          p.batch(s.Hq * p.square(), s.T * p.kv_row(), s.T * p.q_row()));
    // dK_bg (+)= dS_bhᵀ·Q_bh, dV_bg (+)= P_bhᵀ·dO_bh
    const GemmShape gk{.M = s.T, .N = s.D, .K = s.T, .trans_a = true, .lda = s.T, .ldb = p.q_row(),
                       .ldc = p.kv_row(), .accumulate = !first_of_group};
    p.run(gk, f32(dprobs) + h * p.square(), f32(q) + h * s.D, f32w(dk) + kv,
          p.batch(s.Hq * p.square(), s.T * p.q_row(), s.T * p.kv_row()));
    p.run(gk, f32(probs) + h * p.square(), f32(dout) + h * s.D, f32w(dv) + kv,
          p.batch(s.Hq * p.square(), s.T * p.q_row(), s.T * p.kv_row()));
  }
}

}  // namespace

size_t sdpa_planned_workspace_bytes(bool backward, const SdpaShape& s) {
  if (!backward) return 0;
  const auto rows = static_cast<size_t>(s.B * s.Hq * s.T);
  return rows * static_cast<size_t>(s.D) * 4 + 2 * rows * 4;
}

void attention_forward_gpu(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse, float scale,
                           const AttentionWindow& window) {
  SdpaShape s = shape_of(q, k, scale, window, {}, "attention.forward");
  if (q.numel() == 0) return;
  if (q.dtype() == DType::f32) return forward_f32(s, q, k, v, out, lse, window.documents);
  const DeviceDocuments docs =
      window.documents.defined() ? documents_on_device(s, window.documents, q.device()) : DeviceDocuments{};
  const Tensor workspace = sdpa_workspace(false, s, q.device());
  if (dry_run()) return;
  GpuKernels& kernels = gpu_kernels("attention.forward");
  kernels.sdpa_forward(s, q.raw(), k.raw(), v.raw(), out.raw(), docs.pack.defined() ? f32w(docs.stats) : f32w(lse),
                       docs.pack.defined() ? docs.pack.raw() : nullptr, workspace.raw(), workspace.nbytes());
  if (docs.pack.defined()) kernels.lse_transpose(f32(docs.stats), f32w(lse), s.B, s.Hq, s.T, false);
}

void attention_backward_gpu(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                            const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv, float scale,
                            const AttentionWindow& window, AttentionAccumulate accumulate) {
  SdpaShape s = shape_of(q, k, scale, window, accumulate, "attention.backward");
  if (q.numel() == 0) return;
  if (q.dtype() == DType::f32) return backward_f32(s, dout, q, k, v, dq, dk, dv, window.documents);
  const DeviceDocuments docs =
      window.documents.defined() ? documents_on_device(s, window.documents, q.device()) : DeviceDocuments{};
  const Tensor workspace = sdpa_workspace(true, s, q.device());
  if (dry_run()) return;
  GpuKernels& kernels = gpu_kernels("attention.backward");
  if (docs.pack.defined()) kernels.lse_transpose(f32(lse), f32w(docs.stats), s.B, s.Hq, s.T, true);
  kernels.sdpa_backward(s, dout.raw(), q.raw(), k.raw(), v.raw(), out.raw(),
                        docs.pack.defined() ? f32(docs.stats) : f32(lse),
                        docs.pack.defined() ? docs.pack.raw() : nullptr, dq.raw(), dk.raw(), dv.raw(), workspace.raw(),
                        workspace.nbytes());
}

}  // namespace anvil
