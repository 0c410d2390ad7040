#include "anvil/ops/moe_dispatch.h"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "anvil/core/dry_run.h"
#include "anvil/core/error.h"
#include "anvil/core/op_timer.h"
#include "anvil/core/parallel_for.h"

namespace anvil {

namespace {

void check_rows(const Tensor& t, int64_t rows, int64_t D, const char* what) {
  ANVIL_ASSERT(t.ndim() == 2 && t.size(0) == rows && t.size(1) == D && t.dtype() != DType::i32, what, " ",
               shape_str(t.shape()), " must be (", rows, ", ", D, "), f32 or bf16");
}

// Calls f(typed pointers) for a tensor pair of one float dtype.
template <class F>
void by_dtype(const Tensor& a, const Tensor& b, F f) {
  ANVIL_ASSERT(a.dtype() == b.dtype(), "moe dispatch: ", dtype_name(a.dtype()), " against ", dtype_name(b.dtype()));
  if (a.dtype() == DType::f32) f(a.data<float>(), b.data<float>());
  else f(a.data<bf16>(), b.data<bf16>());
}

}  // namespace

ExpertRoutes sort_routes(const Tensor& experts, int64_t num_experts, const std::vector<int64_t>& dry_run_offsets) {
  ANVIL_ASSERT(experts.ndim() == 2 && experts.dtype() == DType::i32, "sort_routes: experts ",
               shape_str(experts.shape()), " must be (M, k) i32");
  ExpertRoutes r;
  r.tokens = experts.size(0), r.top_k = experts.size(1);
  const int64_t n = r.tokens * r.top_k;
  r.order = Tensor::empty({n}, DType::i32, MemCategory::activations, "moe.route_order");
  r.row_of = Tensor::empty({n}, DType::i32, MemCategory::activations, "moe.route_rows");
  if (dry_run()) {
    r.offsets = dry_run_offsets.empty() ? balanced_offsets(n, num_experts) : dry_run_offsets;
    ANVIL_ASSERT(r.offsets.size() == size_t(num_experts + 1) && r.offsets.back() == n, "sort_routes: dry-run offsets of ",
                 r.offsets.size() - 1, " experts for ", n, " routes");
    return r;
  }
  r.offsets.assign(static_cast<size_t>(num_experts + 1), 0);
  const int32_t* ex = experts.data<int32_t>();
  for (int64_t i = 0; i < n; ++i) {
    ANVIL_ASSERT(ex[i] >= 0 && ex[i] < num_experts, "route ", i, " to expert ", ex[i], " of ", num_experts);
    ++r.offsets[static_cast<size_t>(ex[i] + 1)];
  }
  for (int64_t e = 0; e < num_experts; ++e) r.offsets[static_cast<size_t>(e + 1)] += r.offsets[static_cast<size_t>(e)];
  std::vector<int64_t> next(r.offsets.begin(), r.offsets.end() - 1);
  int32_t* order = r.order.data<int32_t>();
  int32_t* row_of = r.row_of.data<int32_t>();
  for (int64_t i = 0; i < n; ++i) {  // in route order: stable within an expert
    const int64_t row = next[static_cast<size_t>(ex[i])]++;
    order[row] = static_cast<int32_t>(i);
    row_of[i] = static_cast<int32_t>(row);
  }
  return r;
}

std::vector<int64_t> balanced_offsets(int64_t routes, int64_t num_experts) {
  std::vector<int64_t> offsets(static_cast<size_t>(num_experts + 1), 0);
  for (int64_t e = 0; e < num_experts; ++e)
    offsets[static_cast<size_t>(e + 1)] =
        offsets[static_cast<size_t>(e)] + routes / num_experts + (e < routes % num_experts ? 1 : 0);
  return offsets;
}

namespace {
// dst row (scatter ? index[i] : i) = src row (scatter ? i : index[i]), rows copied as bytes.
void permute_rows(const Tensor& src, const Tensor& index, Tensor& dst, bool scatter, const char* what) {
  const int64_t n = index.numel();
  ANVIL_ASSERT(index.dtype() == DType::i32 && src.ndim() == 2 && dst.shape() == src.shape() &&
                   src.dtype() == dst.dtype() && src.size(0) == n,
               what, ": src ", shape_str(src.shape()), " dst ", shape_str(dst.shape()), " index of ", n);
  const ScopedOpTime op(what);
  if (dry_run() || n == 0) return;
  const size_t row = static_cast<size_t>(src.size(1)) * dtype_size(src.dtype());
  const int32_t* idx = index.data<int32_t>();
  const char* s = static_cast<const char*>(src.raw());
  char* d = static_cast<char*>(dst.raw());
  parallel_for(0, n, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      ANVIL_ASSERT(idx[i] >= 0 && idx[i] < n, what, ": index ", idx[i], " of ", n, " rows");
      if (scatter) std::memcpy(d + static_cast<size_t>(idx[i]) * row, s + static_cast<size_t>(i) * row, row);
      else std::memcpy(d + static_cast<size_t>(i) * row, s + static_cast<size_t>(idx[i]) * row, row);
    }
  });
}
}  // namespace

void gather_rows(const Tensor& src, const Tensor& index, Tensor& dst) {
  permute_rows(src, index, dst, false, "moe.gather_rows");
}
void scatter_rows(const Tensor& src, const Tensor& index, Tensor& dst) {
  permute_rows(src, index, dst, true, "moe.scatter_rows");
}

void dispatch_forward(const Tensor& x, const ExpertRoutes& routes, Tensor& xe) {
  const int64_t D = x.size(1), n = routes.tokens * routes.top_k;
  check_rows(x, routes.tokens, D, "dispatch: x");
  check_rows(xe, n, D, "dispatch: xe");
  const ScopedOpTime op("moe.dispatch.forward");
  if (dry_run()) return;
  const int32_t* order = routes.order.data<int32_t>();
  by_dtype(x, xe, [&](const auto* src, auto* dst) {
    parallel_for(0, n, 64, [&](int64_t lo, int64_t hi) {
      for (int64_t r = lo; r < hi; ++r) {
        const auto* row = src + (order[r] / routes.top_k) * D;
        std::copy(row, row + D, dst + r * D);
      }
    });
  });
}

void dispatch_backward(const Tensor& dxe, const ExpertRoutes& routes, Tensor& dx) {
  const int64_t D = dx.size(1), k = routes.top_k;
  check_rows(dxe, routes.tokens * k, D, "dispatch backward: dxe");
  check_rows(dx, routes.tokens, D, "dispatch backward: dx");
  const ScopedOpTime op("moe.dispatch.backward");
  if (dry_run()) return;
  const int32_t* row_of = routes.row_of.data<int32_t>();
  by_dtype(dxe, dx, [&](const auto* src, auto* dst) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(dst)>>;
    parallel_for(0, routes.tokens, 16, [&](int64_t lo, int64_t hi) {
      std::vector<float> acc(static_cast<size_t>(D));
      for (int64_t t = lo; t < hi; ++t) {
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t j = 0; j < k; ++j) {  // slot order: a fixed order of sums
          const auto* row = src + row_of[t * k + j] * D;
          for (int64_t d = 0; d < D; ++d) acc[static_cast<size_t>(d)] += to_f32(row[d]);
        }
        for (int64_t d = 0; d < D; ++d) dst[t * D + d] = from_f32<T>(acc[static_cast<size_t>(d)]);
      }
    });
  });
}

void combine_forward(const Tensor& ye, const Tensor& weights, const ExpertRoutes& routes, Tensor& y,
                     const Tensor& residual) {
  const int64_t D = y.size(1), k = routes.top_k;
  check_rows(ye, routes.tokens * k, D, "combine: ye");
  check_rows(y, routes.tokens, D, "combine: y");
  if (residual.defined()) check_rows(residual, routes.tokens, D, "combine: residual");
  ANVIL_ASSERT(!residual.defined() || residual.dtype() == y.dtype(), "combine: residual ",
               dtype_name(residual.dtype()), " for y ", dtype_name(y.dtype()));
  ANVIL_ASSERT(weights.shape() == Shape({routes.tokens, k}) && weights.dtype() == DType::f32, "combine: weights ",
               shape_str(weights.shape()), " must be (", routes.tokens, ", ", k, ") f32");
  const ScopedOpTime op("moe.combine.forward");
  if (dry_run()) return;
  const int32_t* row_of = routes.row_of.data<int32_t>();
  const float* w = weights.data<float>();
  by_dtype(ye, y, [&](const auto* src, auto* dst) {
    using T = std::remove_cv_t<std::remove_pointer_t<decltype(dst)>>;
    const T* res = residual.defined() ? residual.data<T>() : nullptr;
    parallel_for(0, routes.tokens, 16, [&](int64_t lo, int64_t hi) {
      std::vector<float> acc(static_cast<size_t>(D));
      for (int64_t t = lo; t < hi; ++t) {
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t j = 0; j < k; ++j) {
          const auto* row = src + row_of[t * k + j] * D;
          const float wj = w[t * k + j];
          for (int64_t d = 0; d < D; ++d) acc[static_cast<size_t>(d)] += wj * to_f32(row[d]);
        }
        if (res != nullptr)  // the sum, then the residual: one rounding of the block's output
          for (int64_t d = 0; d < D; ++d) acc[static_cast<size_t>(d)] += to_f32(res[t * D + d]);
        for (int64_t d = 0; d < D; ++d) dst[t * D + d] = from_f32<T>(acc[static_cast<size_t>(d)]);
      }
    });
  });
}

void combine_backward(const Tensor& dy, const Tensor& ye, const Tensor& weights, const ExpertRoutes& routes,
                      Tensor& dye, Tensor& dweights) {
  const int64_t D = dy.size(1), k = routes.top_k;
  check_rows(dy, routes.tokens, D, "combine backward: dy");
  check_rows(ye, routes.tokens * k, D, "combine backward: ye");
  check_rows(dye, routes.tokens * k, D, "combine backward: dye");
  ANVIL_ASSERT(weights.shape() == Shape({routes.tokens, k}) && weights.dtype() == DType::f32 &&
                   dweights.shape() == weights.shape() && dweights.dtype() == DType::f32,
               "combine backward: weights ", shape_str(weights.shape()), " and dweights ",
               shape_str(dweights.shape()), " must be (", routes.tokens, ", ", k, ") f32");
  const ScopedOpTime op("moe.combine.backward");
  if (dry_run()) return;
  const int32_t* row_of = routes.row_of.data<int32_t>();
  const float* w = weights.data<float>();
  float* dw = dweights.data<float>();
  by_dtype(dy, ye, [&](const auto* g, const auto* out) {
    by_dtype(dy, dye, [&](const auto*, auto* dout) {
      using T = std::remove_cv_t<std::remove_pointer_t<decltype(dout)>>;
      parallel_for(0, routes.tokens, 16, [&](int64_t lo, int64_t hi) {
        for (int64_t t = lo; t < hi; ++t)
          for (int64_t j = 0; j < k; ++j) {
            const int64_t row = row_of[t * k + j];
            float dot = 0;
            for (int64_t d = 0; d < D; ++d) {
              const float gd = to_f32(g[t * D + d]);
              dot += gd * to_f32(out[row * D + d]);
              dout[row * D + d] = from_f32<T>(w[t * k + j] * gd);
            }
            dw[t * k + j] = dot;
          }
      });
    });
  });
}

}  // namespace anvil
