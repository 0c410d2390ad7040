#include "anvil/ops/attention_gpu.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>

#include "anvil/core/dry_run.h"
#include "anvil/core/error.h"

namespace anvil {

namespace {

SdpaShape shape_of(const Tensor& q, const Tensor& k, float scale, const AttentionWindow& window,
                   AttentionAccumulate accumulate, const char* what) {
  ANVIL_ASSERT(q.size(0) == k.size(0) && q.size(3) == k.size(3), what, ": q ", shape_str(q.shape()), " k ",
               shape_str(k.shape()));
  ANVIL_CHECK(!window.documents.defined(),
              "block-causal attention (documents) does not run on a GPU yet; run with --model.attn_mask_type causal");
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

void forward_f32(const SdpaShape& s, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse) {
  const HeadProducts p{s, q.device()};
  const Tensor probs = Tensor::empty({s.B, s.Hq, s.T, s.T}, DType::f32, MemCategory::workspace,
                                     "attention.probs", q.device());
  scores_of(p, f32(q), f32(k), f32w(probs));
  if (!dry_run())
    gpu_kernels("attention.forward")
        .attention_softmax_forward(f32(probs), f32w(probs), f32w(lse), s.B * s.Hq * s.T, s.T, s.scale);
  const int64_t group = s.Hq / s.Hkv;
  for (int64_t h = 0; h < s.Hq; ++h) {  // O_bh = P_bh·V_bg
    const GemmShape g{.M = s.T, .N = s.D, .K = s.T, .lda = s.T, .ldb = p.kv_row(), .ldc = p.q_row()};
    p.run(g, f32(probs) + h * p.square(), f32(v) + (h / group) * s.D, f32w(out) + h * s.D,
          p.batch(s.Hq * p.square(), s.T * p.kv_row(), s.T * p.q_row()));
  }
}

void backward_f32(const SdpaShape& s, const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
                  const Tensor& dq, const Tensor& dk, const Tensor& dv) {
  const HeadProducts p{s, q.device()};
  const Tensor probs = Tensor::empty({s.B, s.Hq, s.T, s.T}, DType::f32, MemCategory::workspace,
                                     "attention.probs", q.device());
  const Tensor dprobs = Tensor::empty({s.B, s.Hq, s.T, s.T}, DType::f32, MemCategory::workspace,
                                      "attention.dprobs", q.device());
  const Tensor lse = Tensor::empty({s.B, s.Hq, s.T}, DType::f32, MemCategory::workspace, "attention.lse_again",
                                   q.device());
  scores_of(p, f32(q), f32(k), f32w(probs));  // P again, as the forward made it (the same bits)
  if (!dry_run())
    gpu_kernels("attention.backward")
        .attention_softmax_forward(f32(probs), f32w(probs), f32w(lse), s.B * s.Hq * s.T, s.T, s.scale);
  const int64_t group = s.Hq / s.Hkv;
  for (int64_t h = 0; h < s.Hq; ++h) {  // dP_bh = dO_bh·V_bgᵀ
    const GemmShape g{.M = s.T, .N = s.T, .K = s.D, .trans_b = true, .lda = p.q_row(), .ldb = p.kv_row(),
                      .ldc = s.T};
    p.run(g, f32(dout) + h * s.D, f32(v) + (h / group) * s.D, f32w(dprobs) + h * p.square(),
          p.batch(s.T * p.q_row(), s.T * p.kv_row(), s.Hq * p.square()));
  }
  if (!dry_run())  // dS in place of dP
    gpu_kernels("attention.backward")
        .attention_softmax_backward(f32(probs), f32(dprobs), f32w(dprobs), s.B * s.Hq * s.T, s.T, s.scale);
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
  const SdpaShape s = shape_of(q, k, scale, window, {}, "attention.forward");
  if (q.numel() == 0) return;
  if (q.dtype() == DType::f32) return forward_f32(s, q, k, v, out, lse);
  const Tensor workspace = sdpa_workspace(false, s, q.device());
  if (dry_run()) return;
  gpu_kernels("attention.forward")
      .sdpa_forward(s, q.raw(), k.raw(), v.raw(), out.raw(), f32w(lse), workspace.raw(), workspace.nbytes());
}

void attention_backward_gpu(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                            const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv, float scale,
                            const AttentionWindow& window, AttentionAccumulate accumulate) {
  const SdpaShape s = shape_of(q, k, scale, window, accumulate, "attention.backward");
  if (q.numel() == 0) return;
  if (q.dtype() == DType::f32) return backward_f32(s, dout, q, k, v, dq, dk, dv);
  const Tensor workspace = sdpa_workspace(true, s, q.device());
  if (dry_run()) return;
  gpu_kernels("attention.backward")
      .sdpa_backward(s, dout.raw(), q.raw(), k.raw(), v.raw(), out.raw(), static_cast<const float*>(lse.raw()),
                     dq.raw(), dk.raw(), dv.raw(), workspace.raw(), workspace.nbytes());
}

}  // namespace anvil
