// What the ops launch on a GPU. Every op checks its tensors and allocates its
// outputs' scratch at its entry, whatever the device; then a host tensor runs
// the CPU kernels, and a device tensor the calls below, over device pointers,
// in the device's one stream's order, returning at once. The GPU side of an op
// (ops/*_gpu.cpp and the device branches of the small ops) is plain C++ that
// every build compiles: in a dry run (core/dry_run.h) it allocates exactly what
// the GPU run allocates, from the fake device's pool, and returns before
// calling anything here, so a binary without CUDA still runs the GPU path's
// allocations. The CUDA backend implements the calls (ops/cuda/gpu_kernels.cpp)
// and registers them at start-up; a binary without it has none, and an op on a
// device tensor then throws naming the op.
//
// Types are DType's f32 (float) and bf16 (uint16_t bits on the device).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "anvil/core/dtype.h"
#include "anvil/core/tensor.h"
#include "anvil/ops/adamw.h"
#include "anvil/ops/gemm_layout.h"

namespace anvil {

// One attention's shape on the GPU (q, out (B, T, Hq, D); k, v (B, T, Hkv, D)).
// Block-causal attention gives its documents' ragged batch and length
// (ops/sdpa_layout.h's SdpaDocuments), which pick cuDNN's graph as the sizes do.
struct SdpaShape {
  int64_t B = 0, T = 0, Hq = 0, Hkv = 0, D = 0;
  float scale = 0;  // 0: 1/sqrt(D)
  int64_t docs_batch = 0, docs_max_seq = 0;  // 0: causal over whole sequences
};

class GpuKernels {
 public:
  virtual ~GpuKernels() = default;

  // One cuBLASLt matmul over a workspace of `workspace_bytes`.
  virtual void gemm(const LtMatmul& call, const void* A, const void* B, void* C, void* workspace,
                    size_t workspace_bytes) = 0;

  // ops/cuda/rmsnorm.h: x, y, dy, dx of type t, dw of dw_type; rstd (M) f32.
  virtual void rmsnorm_forward(DType t, const void* x, const void* w, float eps, void* y, float* rstd, int64_t M,
                               int64_t D) = 0;
  virtual void rmsnorm_backward(DType t, DType dw_type, const void* dy, const void* x, const void* w,
                                const float* rstd, void* dx, void* dw, float* scratch, int64_t M, int64_t D,
                                bool accumulate_dx) = 0;

  // ops/cuda/rope.h: inverse is the backward (rotation by −θ).
  virtual void rope(bool inverse, DType t, const void* x, const float* cos, const float* sin, int64_t max_positions,
                    int64_t B, int64_t T, int64_t H, int64_t D, int64_t pos_offset, void* y) = 0;

  // ops/cuda/swiglu.h, over n elements.
  virtual void swiglu_forward(DType t, const void* g, const void* u, void* h, int64_t n) = 0;
  virtual void swiglu_backward(DType t, const void* dh, const void* g, const void* u, void* dg, void* du,
                               int64_t n) = 0;

  // ops/cuda/embedding.h: out (M, D) of out_type from a (V, D) table of
  // table_type; the backward adds into dtable.
  virtual void embedding_forward(const int32_t* tokens, int64_t M, DType table_type, const void* table, int64_t V,
                                 int64_t D, DType out_type, void* out) = 0;
  virtual void embedding_backward(DType dout_type, const void* dout, const int32_t* tokens, int64_t M, int64_t V,
                                  int64_t D, DType grad_type, void* dtable) = 0;

  // cuDNN's fused SDPA (ops/cuda/sdpa.h), bf16, causal, or block-causal
  // where shape.docs_batch > 0: then `documents` is the device copy of the
  // documents' pack (ops/sdpa_layout.h) and `stats` the token-major (B·T, Hq)
  // statistics; else documents is null and stats is the lse (B, Hq, T). The
  // workspace a shape's graph needs is asked of the GPU (its graph is built then).
  virtual size_t sdpa_workspace_bytes(bool backward, const SdpaShape& shape) = 0;
  virtual void sdpa_forward(const SdpaShape& shape, const void* q, const void* k, const void* v, void* out,
                            float* stats, const void* documents, void* workspace, size_t workspace_bytes) = 0;
  virtual void sdpa_backward(const SdpaShape& shape, const void* dout, const void* q, const void* k, const void* v,
                             const void* out, const float* stats, const void* documents, void* dq, void* dk, void* dv,
                             void* workspace, size_t workspace_bytes) = 0;
  // ops/cuda/lse_layout.h: the lse (B, H, T) to token-major (B, T, H), or back.
  virtual void lse_transpose(const float* src, float* dst, int64_t B, int64_t H, int64_t T, bool to_token_major) = 0;

  // The fp32 attention's causal row softmax (ops/cuda/attention_softmax.h);
  // under documents first_key holds each row's first key (else null: 0).
  virtual void attention_softmax_forward(const float* scores, float* probs, float* lse, int64_t rows, int64_t T,
                                         float scale, const int32_t* first_key) = 0;
  virtual void attention_softmax_backward(const float* probs, const float* dprobs, float* dscores, int64_t rows,
                                          int64_t T, float scale, const int32_t* first_key) = 0;

  // The loss head's row work (ops/cuda/cross_entropy.h).
  virtual void cross_entropy_lse_update(const float* logits, int64_t rows, int64_t cols, int64_t v0,
                                        const int32_t* targets, int32_t ignore_index, bool first_chunk,
                                        float* row_max, float* row_sum, float* row_target) = 0;
  virtual void cross_entropy_loss(const float* row_max, const float* row_sum, const float* row_target,
                                  const int32_t* targets, int32_t ignore_index, int64_t M, float* lse,
                                  double* loss_sum, int64_t* num_tokens) = 0;
  virtual void cross_entropy_dlogits(DType t, const float* logits, void* dlogits, int64_t rows, int64_t cols,
                                     int64_t v0, const int32_t* targets, int32_t ignore_index, const float* lse,
                                     float scale) = 0;

  // ops/cuda/adamw.h over n elements; p_bf16 may be null.
  virtual void adamw_step(const AdamWConfig& cfg, int64_t step, float* p, const float* g, float* m, float* v,
                          uint16_t* p_bf16, int64_t n, float grad_scale) = 0;

  // ops/cuda/grad_norm.h: out (one double) = Σ x², over `workspace`
  // (grad_sum_of_squares_workspace() doubles); the scaling in place.
  virtual void grad_sum_of_squares(DType t, const void* x, int64_t n, double* workspace, double* out) = 0;
  virtual void scale_grads(DType t, void* x, int64_t n, float scale) = 0;
};

// Whether an op's tensors are on a GPU: all of them (the undefined ones
// aside) must be where the first is, or the op throws naming them.
void check_same_device(std::string_view op, const Tensor& first, const Tensor& other);
template <class... Rest>
bool on_gpu(std::string_view op, const Tensor& first, const Rest&... rest) {
  (check_same_device(op, first, rest), ...);
  return !first.device().is_cpu();
}

// Registers the backend's kernels (not owned; null removes them).
void set_gpu_kernels(GpuKernels* kernels);
// The registered kernels, for `op` on a device tensor; throws anvil::Error
// naming the op where this binary has none (built without CUDA).
GpuKernels& gpu_kernels(std::string_view op);

// cuBLASLt's workspace (split-K reductions and the like): NVIDIA's recommended
// 32 MiB for Hopper (cuBLAS documentation, cublasSetWorkspace; 4 MiB suffices
// on Ampere). One fixed buffer per device, made from the device's pool on
// first use and kept (category workspace), so it is counted in the memory
// snapshot and the dry run like any tensor; the heuristic is told the size and
// picks only algorithms that fit. A dry run's is its own, dropped with it.
inline constexpr size_t kCublasLtWorkspaceBytes = size_t{32} << 20;
const Tensor& gemm_workspace(Device device);

// C (+)= alpha·op(A)·op(B) on `device` (Anvil's row-major GemmShape, device
// pointers), as the cuBLASLt call lt_matmul_of makes of it, over the device's
// workspace. Empty products do nothing; K = 0 must accumulate (C += 0).
void gpu_gemm(Device device, const GemmShape& s, const void* A, const void* B, void* C, const GemmBatch& batch = {});

}  // namespace anvil
