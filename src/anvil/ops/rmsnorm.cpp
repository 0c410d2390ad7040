#include "anvil/ops/rmsnorm.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>

#include "anvil/core/dry_run.h"
#include "anvil/core/op_timer.h"
#include "anvil/core/parallel_for.h"
#include "anvil/ops/cuda/rmsnorm_body.h"  // the GPU backward's row splits (plain C++)
#include "anvil/ops/gpu_kernels.h"
#include "anvil/ops/vec16.h"

namespace anvil {

namespace {

using namespace vec16;  // the 16-lane vector helpers (ops/vec16.h)

// Σ x² over a row, with four accumulators (shorter dependency chains, and each
// accumulator sums a quarter of the row, which also helps f32 accuracy).
template <class T>
float sum_squares(const T* x, int64_t D) {
  V a0 = splat(0), a1 = splat(0), a2 = splat(0), a3 = splat(0);
  int64_t j = 0;
  for (; j + 4 * kW <= D; j += 4 * kW) {
    const V x0 = load(x + j), x1 = load(x + j + kW), x2 = load(x + j + 2 * kW), x3 = load(x + j + 3 * kW);
    a0 = mul_add(x0, x0, a0), a1 = mul_add(x1, x1, a1), a2 = mul_add(x2, x2, a2), a3 = mul_add(x3, x3, a3);
  }
  for (; j + kW <= D; j += kW) {
    const V v = load(x + j);
    a0 = mul_add(v, v, a0);
  }
  if (j < D) {
    const V v = load(x + j, D - j);
    a1 = mul_add(v, v, a1);
  }
  return hsum((a0 + a1) + (a2 + a3));
}

// Rows per parallel task, so each task moves a few hundred KB: big enough to
// amortise the fork, small enough that both cores get work at M = a few rows.
int64_t row_grain(int64_t D) { return std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, D)); }

float rstd_of(float sum_sq, int64_t D, float eps) {
  return 1.0f / std::sqrt(sum_sq / static_cast<float>(D) + eps);
}

template <class T>
void forward_kernel(const T* x, const T* w, float eps, T* y, float* rstd, int64_t M, int64_t D) {
  parallel_for(0, M, row_grain(D), [&](int64_t lo, int64_t hi) {
    for (int64_t m = lo; m < hi; ++m) {
      const T* xr = x + m * D;
      T* yr = y + m * D;
      // Second read of the row below hits L1/L2: one pass over memory.
      const float r = rstd_of(sum_squares(xr, D), D, eps);
      if (rstd) rstd[m] = r;
      const V rv = splat(r);
      int64_t j = 0;
      for (; j + kW <= D; j += kW) store(yr + j, load(xr + j) * rv * load(w + j));
      if (j < D) store(yr + j, load(xr + j, D - j) * rv * load(w + j, D - j), D - j);
    }
  });
}

// With r = rstd of the row and dot = Σ_k dy_k·w_k·x_k:
//   dx_j = r·dy_j·w_j − (r³/D)·dot·x_j      (∂r/∂x_k = −r³·x_k/D)
//   dw_j += dy_j·x_j·r
// Per row: one sweep for dot (and Σx² when rstd was not saved), one sweep that
// writes dx and adds into the chunk's dw partial; both read x, dy, w from L1.
template <class T>
void backward_row(const T* dy, const T* x, const T* w, const float* rstd_saved, float eps, int64_t D, T* dx,
                  float* pdw, bool accumulate_dx) {
  V d0 = splat(0), d1 = splat(0), s0 = splat(0), s1 = splat(0);
  int64_t j = 0;
  for (; j + kW <= D; j += kW) {
    const V xv = load(x + j);
    d0 = mul_add(load(dy + j) * load(w + j), xv, d0);
    if (!rstd_saved) s0 = mul_add(xv, xv, s0);
  }
  if (j < D) {
    const V xv = load(x + j, D - j);
    d1 = mul_add(load(dy + j, D - j) * load(w + j, D - j), xv, d1);
    s1 = mul_add(xv, xv, s1);
  }
  const float r = rstd_saved ? *rstd_saved : rstd_of(hsum(s0 + s1), D, eps);
  const float dot = hsum(d0 + d1);
  const V rv = splat(r);
  const V cv = splat(r * r * r * dot / static_cast<float>(D));
  auto dx_of = [&](V dyv, V wv, V xv) { return dyv * wv * rv - cv * xv; };
  for (j = 0; j + kW <= D; j += kW) {
    const V xv = load(x + j), dyv = load(dy + j);
    V g = dx_of(dyv, load(w + j), xv);
    if (accumulate_dx) g = g + load(dx + j);
    store(dx + j, g);
    store(pdw + j, mul_add(dyv * xv, rv, load(pdw + j)));
  }
  if (j < D) {
    const int64_t n = D - j;
    const V xv = load(x + j, n), dyv = load(dy + j, n);
    V g = dx_of(dyv, load(w + j, n), xv);
    if (accumulate_dx) g = g + load(dx + j, n);
    store(dx + j, g, n);
    store(pdw + j, mul_add(dyv * xv, rv, load(pdw + j, n)), n);
  }
}

template <class T, class G>
void backward_kernel(const T* dy, const T* x, const T* w, const float* rstd, float eps, T* dx, G* dw, int64_t M,
                     int64_t D, bool accumulate_dx) {
  // dw is a reduction over rows. Fixed chunks of rows (a function of the shape
  // only, not of the thread count) each sum into their own f32 partial row;
  // then the partials are summed column-wise into dw. Race-free, deterministic,
  // and the partials cost ~0.5% of the traffic at D = 2048 (one 8 KB row per
  // 256 rows of input).
  const int64_t rows_per_chunk = std::max<int64_t>(16, (int64_t{1} << 19) / std::max<int64_t>(1, D));
  const int64_t chunks = (M + rows_per_chunk - 1) / rows_per_chunk;
  Tensor partial = Tensor::empty({chunks, D}, DType::f32, MemCategory::workspace, "rmsnorm.dw_partial");
  if (dry_run()) return;
  float* part = partial.data<float>();
  parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      float* pdw = part + c * D;
      std::memset(pdw, 0, static_cast<size_t>(D) * sizeof(float));
      const int64_t hi = std::min(M, (c + 1) * rows_per_chunk);
      for (int64_t m = c * rows_per_chunk; m < hi; ++m)
        backward_row(dy + m * D, x + m * D, w, rstd ? rstd + m : nullptr, eps, D, dx + m * D, pdw, accumulate_dx);
    }
  });
  parallel_for(0, D, 4096, [&](int64_t lo, int64_t hi) {
    for (int64_t j = lo; j < hi; ++j) {
      float s = 0;
      for (int64_t c = 0; c < chunks; ++c) s += part[c * D + j];
      dw[j] = from_f32<G>(to_f32(dw[j]) + s);
    }
  });
}

}  // namespace

void rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, Tensor& y, const Tensor& rstd) {
  const ScopedOpTime op("rmsnorm.forward");
  ANVIL_ASSERT(x.ndim() >= 1 && w.ndim() == 1 && x.size(-1) == w.size(0), "rmsnorm: x ", shape_str(x.shape()),
               " w ", shape_str(w.shape()));
  ANVIL_ASSERT(x.dtype() != DType::i32 && w.dtype() == x.dtype() && y.dtype() == x.dtype(),
               "rmsnorm: x, w, y must share one float dtype");
  ANVIL_ASSERT(y.shape() == x.shape(), "rmsnorm: y ", shape_str(y.shape()), " vs x ", shape_str(x.shape()));
  const int64_t D = w.size(0), M = D ? x.numel() / D : 0;
  if (rstd.defined())
    ANVIL_ASSERT(rstd.dtype() == DType::f32 && rstd.numel() == M, "rmsnorm: rstd ", shape_str(rstd.shape()));
  if (on_gpu("rmsnorm.forward", x, w, y, rstd)) {
    if (M == 0 || D == 0 || dry_run()) return;
    return gpu_kernels("rmsnorm.forward")
        .rmsnorm_forward(x.dtype(), x.raw(), w.raw(), eps, y.raw(),
                         rstd.defined() ? static_cast<float*>(rstd.raw()) : nullptr, M, D);
  }
  float* rs = rstd.defined() ? rstd.data<float>() : nullptr;
  if (M == 0 || D == 0 || dry_run()) return;
  if (x.dtype() == DType::f32)
    forward_kernel(x.data<float>(), w.data<float>(), eps, y.data<float>(), rs, M, D);
  else
    forward_kernel(x.data<bf16>(), w.data<bf16>(), eps, y.data<bf16>(), rs, M, D);
}

void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& w, const Tensor& rstd, float eps, Tensor& dx,
                      Tensor& dw, bool accumulate_dx) {
  const ScopedOpTime op("rmsnorm.backward");
  ANVIL_ASSERT(x.ndim() >= 1 && w.ndim() == 1 && x.size(-1) == w.size(0), "rmsnorm: x ", shape_str(x.shape()),
               " w ", shape_str(w.shape()));
  ANVIL_ASSERT(x.dtype() != DType::i32 && w.dtype() == x.dtype() && dy.dtype() == x.dtype() &&
                   dx.dtype() == x.dtype(),
               "rmsnorm backward: x, w, dy, dx must share one float dtype");
  ANVIL_ASSERT(dy.shape() == x.shape() && dx.shape() == x.shape(), "rmsnorm backward: dy ", shape_str(dy.shape()),
               " dx ", shape_str(dx.shape()), " x ", shape_str(x.shape()));
  ANVIL_ASSERT(dw.shape() == w.shape() && dw.dtype() != DType::i32, "rmsnorm backward: dw ", shape_str(dw.shape()));
  const int64_t D = w.size(0), M = D ? x.numel() / D : 0;
  if (rstd.defined())
    ANVIL_ASSERT(rstd.dtype() == DType::f32 && rstd.numel() == M, "rmsnorm: rstd ", shape_str(rstd.shape()));
  if (on_gpu("rmsnorm.backward", x, dy, w, dx, dw, rstd)) {
    ANVIL_ASSERT(rstd.defined(), "rmsnorm backward on a GPU needs the forward's rstd");
    if (M == 0 || D == 0) return;
    // One f32 dW partial per fixed split of rows (the same bits every run).
    const Tensor scratch = Tensor::empty({kernel::rmsnorm_dw_splits(M) * D}, DType::f32, MemCategory::workspace,
                                         "rmsnorm.dw_partials", x.device());
    if (dry_run()) return;
    return gpu_kernels("rmsnorm.backward")
        .rmsnorm_backward(x.dtype(), dw.dtype(), dy.raw(), x.raw(), w.raw(), static_cast<const float*>(rstd.raw()),
                          dx.raw(), dw.raw(), static_cast<float*>(scratch.raw()), M, D, accumulate_dx);
  }
  const float* rs = rstd.defined() ? rstd.data<float>() : nullptr;
  if (M == 0 || D == 0) return;
  auto run = [&](auto* dwp) {
    if (x.dtype() == DType::f32)
      backward_kernel(dy.data<float>(), x.data<float>(), w.data<float>(), rs, eps, dx.data<float>(), dwp, M, D,
                      accumulate_dx);
    else
      backward_kernel(dy.data<bf16>(), x.data<bf16>(), w.data<bf16>(), rs, eps, dx.data<bf16>(), dwp, M, D,
                      accumulate_dx);
  };
  if (dw.dtype() == DType::f32)
    run(dw.data<float>());
  else
    run(dw.data<bf16>());
}

}  // namespace anvil
