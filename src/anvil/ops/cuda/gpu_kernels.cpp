// The CUDA backend's GpuKernels (ops/gpu_kernels.h): each call the launch of
// its CUDA twin on the one stream, its storage types picked from the DTypes.
#include "anvil/ops/gpu_kernels.h"

#include <mutex>
#include <type_traits>

#include "anvil/core/error.h"
#include "anvil/ops/cuda/adamw.h"
#include "anvil/ops/cuda/attention_softmax.h"
#include "anvil/ops/cuda/cross_entropy.h"
#include "anvil/ops/cuda/device_runtime.h"
#include "anvil/ops/cuda/embedding.h"
#include "anvil/ops/cuda/gemm.h"
#include "anvil/ops/cuda/grad_norm.h"
#include "anvil/ops/cuda/lse_layout.h"
#include "anvil/ops/cuda/rmsnorm.h"
#include "anvil/ops/cuda/rope.h"
#include "anvil/ops/cuda/sdpa.h"
#include "anvil/ops/cuda/swiglu.h"

namespace anvil {

namespace {

// Calls fn with a null pointer of the storage type of t (float, or uint16_t for bf16).
template <class F>
void with_type(DType t, const char* what, F&& fn) {
  switch (t) {
    case DType::f32: return fn(static_cast<float*>(nullptr));
    case DType::bf16: return fn(static_cast<uint16_t*>(nullptr));
    default: throw Error(detail::concat(what, " on the GPU takes f32 or bf16, got ", dtype_name(t)));
  }
}

template <class T>
const T* in(const void* p) {
  return static_cast<const T*>(p);
}
template <class T>
T* out(void* p) {
  return static_cast<T*>(p);
}

class CudaKernels final : public GpuKernels {
 public:
  void gemm(const LtMatmul& call, const void* A, const void* B, void* C, void* workspace,
            size_t workspace_bytes) override {
    gemm_cuda(call, A, B, C, workspace, workspace_bytes, cuda_stream());
  }

  void rmsnorm_forward(DType t, const void* x, const void* w, float eps, void* y, float* rstd, int64_t M,
                       int64_t D) override {
    with_type(t, "rmsnorm", [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      rmsnorm_forward_cuda<T>(in<T>(x), in<T>(w), eps, out<T>(y), rstd, M, D, cuda_stream());
    });
  }
  void rmsnorm_backward(DType t, DType dw_type, const void* dy, const void* x, const void* w, const float* rstd,
                        void* dx, void* dw, float* scratch, int64_t M, int64_t D, bool accumulate_dx) override {
    with_type(t, "rmsnorm", [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      with_type(dw_type, "rmsnorm's weight gradient", [&](auto* gtag) {
        using G = std::remove_pointer_t<decltype(gtag)>;
        rmsnorm_backward_cuda<T, G>(in<T>(dy), in<T>(x), in<T>(w), rstd, out<T>(dx), out<G>(dw), scratch, M, D,
                                    accumulate_dx, cuda_stream());
      });
    });
  }

  void rope(bool inverse, DType t, const void* x, const float* cos, const float* sin, int64_t max_positions,
            int64_t B, int64_t T_, int64_t H, int64_t D, int64_t pos_offset, void* y) override {
    with_type(t, "rope", [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      if (inverse)
        rope_backward_cuda<T>(in<T>(x), cos, sin, max_positions, B, T_, H, D, pos_offset, out<T>(y), cuda_stream());
      else
        rope_forward_cuda<T>(in<T>(x), cos, sin, max_positions, B, T_, H, D, pos_offset, out<T>(y), cuda_stream());
    });
  }

  void swiglu_forward(DType t, const void* g, const void* u, void* h, int64_t n) override {
    with_type(t, "swiglu", [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      swiglu_forward_cuda<T>(in<T>(g), in<T>(u), out<T>(h), n, cuda_stream());
    });
  }
  void swiglu_backward(DType t, const void* dh, const void* g, const void* u, void* dg, void* du,
                       int64_t n) override {
    with_type(t, "swiglu", [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      swiglu_backward_cuda<T>(in<T>(dh), in<T>(g), in<T>(u), out<T>(dg), out<T>(du), n, cuda_stream());
    });
  }

  void embedding_forward(const int32_t* tokens, int64_t M, DType table_type, const void* table, int64_t V,
                         int64_t D, DType out_type, void* o) override {
    with_type(table_type, "embedding", [&](auto* ttag) {
      using Table = std::remove_pointer_t<decltype(ttag)>;
      with_type(out_type, "embedding", [&](auto* otag) {
        using Out = std::remove_pointer_t<decltype(otag)>;
        embedding_forward_cuda<Table, Out>(tokens, M, in<Table>(table), V, D, out<Out>(o), cuda_stream());
      });
    });
  }
  void embedding_backward(DType dout_type, const void* dout, const int32_t* tokens, int64_t M, int64_t V, int64_t D,
                          DType grad_type, void* dtable) override {
    with_type(dout_type, "embedding", [&](auto* dtag) {
      using Dout = std::remove_pointer_t<decltype(dtag)>;
      with_type(grad_type, "embedding", [&](auto* gtag) {
        using Grad = std::remove_pointer_t<decltype(gtag)>;
        embedding_backward_cuda<Dout, Grad>(in<Dout>(dout), tokens, M, V, D, out<Grad>(dtable), cuda_stream());
      });
    });
  }

  size_t sdpa_workspace_bytes(bool backward, const SdpaShape& shape) override {
    return backward ? sdpa_backward_workspace_bytes(shape) : sdpa_forward_workspace_bytes(shape);
  }
  void sdpa_forward(const SdpaShape& shape, const void* q, const void* k, const void* v, void* o, float* stats,
                    const void* documents, void* workspace, size_t workspace_bytes) override {
    sdpa_forward_cuda(shape, q, k, v, o, stats, documents, workspace, workspace_bytes, cuda_stream());
  }
  void sdpa_backward(const SdpaShape& shape, const void* dout, const void* q, const void* k, const void* v,
                     const void* o, const float* stats, const void* documents, void* dq, void* dk, void* dv,
                     void* workspace, size_t workspace_bytes) override {
    sdpa_backward_cuda(shape, dout, q, k, v, o, stats, documents, dq, dk, dv, workspace, workspace_bytes,
                       cuda_stream());
  }
  void lse_transpose(const float* src, float* dst, int64_t B, int64_t H, int64_t T, bool to_token_major) override {
    lse_transpose_cuda(src, dst, B, H, T, to_token_major, cuda_stream());
  }

  void attention_softmax_forward(const float* scores, float* probs, float* lse, int64_t rows, int64_t T,
                                 float scale, const int32_t* first_key) override {
    attention_softmax_forward_cuda(scores, probs, lse, rows, T, scale, first_key, cuda_stream());
  }
  void attention_softmax_backward(const float* probs, const float* dprobs, float* dscores, int64_t rows, int64_t T,
                                  float scale, const int32_t* first_key) override {
    attention_softmax_backward_cuda(probs, dprobs, dscores, rows, T, scale, first_key, cuda_stream());
  }

  void cross_entropy_lse_update(const float* logits, int64_t rows, int64_t cols, int64_t v0, const int32_t* targets,
                                int32_t ignore_index, bool first_chunk, float* row_max, float* row_sum,
                                float* row_target) override {
    cross_entropy_lse_update_cuda(logits, rows, cols, v0, targets, ignore_index, first_chunk, row_max, row_sum,
                                  row_target, cuda_stream());
  }
  void cross_entropy_loss(const float* row_max, const float* row_sum, const float* row_target, const int32_t* targets,
                          int32_t ignore_index, int64_t M, float* lse, double* loss_sum,
                          int64_t* num_tokens) override {
    cross_entropy_loss_cuda(row_max, row_sum, row_target, targets, ignore_index, M, lse, loss_sum, num_tokens,
                            cuda_stream());
  }
  void cross_entropy_dlogits(DType t, const float* logits, void* dlogits, int64_t rows, int64_t cols, int64_t v0,
                             const int32_t* targets, int32_t ignore_index, const float* lse, float scale) override {
    with_type(t, "cross_entropy", [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      cross_entropy_dlogits_cuda<T>(logits, out<T>(dlogits), rows, cols, v0, targets, ignore_index, lse, scale,
                                    cuda_stream());
    });
  }

  void adamw_step(const AdamWConfig& cfg, int64_t step, float* p, const float* g, float* m, float* v,
                  uint16_t* p_bf16, int64_t n, float grad_scale) override {
    adamw_step_cuda(cfg, step, p, g, m, v, p_bf16, n, grad_scale, cuda_stream());
  }

  void grad_sum_of_squares(DType t, const void* x, int64_t n, double* workspace, double* o) override {
    with_type(t, "grad_norm", [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      grad_sum_of_squares_cuda(in<T>(x), n, workspace, o, cuda_stream());
    });
  }
  void scale_grads(DType t, void* x, int64_t n, float scale) override {
    with_type(t, "scale_grads", [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      scale_grads_cuda(out<T>(x), n, scale, cuda_stream());
    });
  }
};

}  // namespace

void register_cuda_kernels() {
  static CudaKernels* kernels = new CudaKernels;  // never destroyed, as the runtime
  static std::once_flag once;
  std::call_once(once, [] { set_gpu_kernels(kernels); });
}

}  // namespace anvil
