#include "anvil/ops/cross_entropy_gpu.h"

#include <algorithm>
#include <cstring>

#include "anvil/core/dry_run.h"
#include "anvil/core/error.h"
#include "anvil/ops/gpu_kernels.h"

namespace anvil {

int64_t cross_entropy_gpu_chunk(int64_t M, int64_t V) {
  constexpr int64_t kLogitsBytes = int64_t{64} << 20, kAlign = 128;
  const int64_t fit = kLogitsBytes / (4 * std::max<int64_t>(1, M)) / kAlign * kAlign;
  return std::clamp<int64_t>(fit, kAlign, std::max<int64_t>(V, 1));
}

CrossEntropyResult cross_entropy_gpu(const Tensor& x, const Tensor& w, const Tensor& targets,
                                     const CrossEntropyOptions& opt, float grad_scale, Tensor* dx, Tensor* dw) {
  const int64_t M = x.size(0), D = x.size(1), V = w.size(0);
  const Device device = x.device();
  const bool backward = dx != nullptr;
  if (backward) {
    ANVIL_ASSERT(dw != nullptr && dx->shape() == x.shape() && dw->shape() == w.shape() && dx->dtype() != DType::i32 &&
                     dw->dtype() != DType::i32,
                 "cross_entropy backward: dx ", shape_str(dx->shape()), " dw ", shape_str(dw->shape()));
    check_same_device("cross_entropy", x, *dx);
    check_same_device("cross_entropy", x, *dw);
  }
  if (M == 0) return {};
  const int64_t C = opt.vocab_chunk > 0 ? std::min(opt.vocab_chunk, V) : cross_entropy_gpu_chunk(M, V);
  const auto row = [&](const char* tag) { return Tensor::empty({M}, DType::f32, MemCategory::workspace, tag, device); };
  const Tensor row_max = row("cross_entropy.row_max"), row_sum = row("cross_entropy.row_sum"),
               row_target = row("cross_entropy.row_target"), lse = row("cross_entropy.lse");
  // One double (the loss) and one int64 (its tokens), in f32 storage.
  const Tensor sums = Tensor::empty({4}, DType::f32, MemCategory::workspace, "cross_entropy.loss", device);
  const Tensor logits = Tensor::empty({M, C}, DType::f32, MemCategory::workspace, "cross_entropy.logits", device);
  const auto* tgt = static_cast<const int32_t*>(targets.raw());
  // The chunk's logits = x·w[v0 : v0 + cols]ᵀ, dense (M, cols) in the (M, C) buffer, as the row work reads them.
  const auto logits_of = [&](int64_t v0, int64_t cols) {
    const GemmShape g{.M = M, .N = cols, .K = D, .trans_b = true, .ab = x.dtype(), .c = DType::f32};
    gpu_gemm(device, g, x.raw(), static_cast<const char*>(w.raw()) + v0 * D * dtype_size(w.dtype()), logits.raw());
  };
  GpuKernels* k = dry_run() ? nullptr : &gpu_kernels("cross_entropy");
  for (int64_t v0 = 0; v0 < V; v0 += C) {
    const int64_t cols = std::min(C, V - v0);
    logits_of(v0, cols);
    if (k)
      k->cross_entropy_lse_update(static_cast<const float*>(logits.raw()), M, cols, v0, tgt, opt.ignore_index,
                                  v0 == 0, static_cast<float*>(row_max.raw()), static_cast<float*>(row_sum.raw()),
                                  static_cast<float*>(row_target.raw()));
  }
  CrossEntropyResult result{0, M};  // a dry run's rows all count, as on the CPU
  if (k) {
    auto* loss = static_cast<double*>(sums.raw());
    k->cross_entropy_loss(static_cast<const float*>(row_max.raw()), static_cast<const float*>(row_sum.raw()),
                          static_cast<const float*>(row_target.raw()), tgt, opt.ignore_index, M,
                          static_cast<float*>(lse.raw()), loss, reinterpret_cast<int64_t*>(loss + 1));
  }
  if (backward) {
    const bool f32_dx = dx->dtype() == DType::f32;
    // dlogits in the products' operand type; f32 dlogits overwrite the logits.
    const Tensor dlogits = x.dtype() == DType::f32
                               ? logits
                               : Tensor::empty({M, C}, x.dtype(), MemCategory::workspace, "cross_entropy.dlogits",
                                               device);
    const Tensor dx_acc = f32_dx ? *dx
                                 : Tensor::empty({M, D}, DType::f32, MemCategory::workspace, "cross_entropy.dx_f32",
                                                 device);
    const size_t wsize = dtype_size(w.dtype()), dwsize = dtype_size(dw->dtype());
    for (int64_t v0 = 0; v0 < V; v0 += C) {
      const int64_t cols = std::min(C, V - v0);
      logits_of(v0, cols);
      if (k)
        k->cross_entropy_dlogits(x.dtype(), static_cast<const float*>(logits.raw()), dlogits.raw(), M, cols, v0, tgt,
                                 opt.ignore_index, static_cast<const float*>(lse.raw()), grad_scale);
      // dx (+)= dlogits·w_c
      const GemmShape gx{.M = M, .N = D, .K = cols, .ab = x.dtype(), .c = DType::f32,
                         .accumulate = v0 > 0};
      gpu_gemm(device, gx, dlogits.raw(), static_cast<const char*>(w.raw()) + v0 * D * wsize, dx_acc.raw());
      // dw_c += dlogits_cᵀ·x
      const GemmShape gw{.M = cols, .N = D, .K = M, .trans_a = true, .ab = x.dtype(), .c = dw->dtype(),
                         .accumulate = true};
      gpu_gemm(device, gw, dlogits.raw(), x.raw(), static_cast<char*>(dw->raw()) + v0 * D * dwsize);
    }
    if (!f32_dx) dx->copy_from(dx_acc);
  }
  if (k) {
    const Tensor host = sums.to(Device::cpu(), MemCategory::workspace, "cross_entropy.loss");
    std::memcpy(&result.loss_sum, host.data<float>(), sizeof(double));
    std::memcpy(&result.num_tokens, host.data<float>() + 2, sizeof(int64_t));
  }
  return result;
}

}  // namespace anvil
