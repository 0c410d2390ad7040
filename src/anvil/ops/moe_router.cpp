#include "anvil/ops/moe_router.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "anvil/core/dry_run.h"
#include "anvil/core/error.h"
#include "anvil/core/op_timer.h"
#include "anvil/core/parallel_for.h"

namespace anvil {

namespace {

struct RouterDims {
  int64_t M, E, k;
};

RouterDims check_probs(const Tensor& probs, const Tensor& experts, const char* what) {
  ANVIL_ASSERT(probs.ndim() == 2 && probs.dtype() == DType::f32, what, ": probs ", shape_str(probs.shape()),
               " must be (M, E) f32");
  ANVIL_ASSERT(experts.ndim() == 2 && experts.dtype() == DType::i32 && experts.size(0) == probs.size(0), what,
               ": experts ", shape_str(experts.shape()), " must be (M, k) i32 for probs ", shape_str(probs.shape()));
  return {probs.size(0), probs.size(1), experts.size(1)};
}

}  // namespace

std::vector<int64_t> balanced_route_offsets(int64_t M, int64_t num_experts, const RouterConfig& cfg) {
  std::vector<int64_t> offsets(static_cast<size_t>(num_experts + 1), 0);
  for (int64_t t = 0; t < M; ++t) {
    const int64_t p = balanced_position(cfg, t);
    for (int64_t j = 0; j < cfg.top_k; ++j) ++offsets[static_cast<size_t>(balanced_expert(p, j, cfg.top_k, num_experts) + 1)];
  }
  for (int64_t e = 0; e < num_experts; ++e) offsets[static_cast<size_t>(e + 1)] += offsets[static_cast<size_t>(e)];
  return offsets;
}

void router_forward(const Tensor& logits, const RouterConfig& cfg, Tensor& probs, Tensor& experts, Tensor& weights) {
  ANVIL_ASSERT(logits.ndim() == 2 && logits.dtype() == DType::f32, "router: logits ", shape_str(logits.shape()),
               " must be (M, E) f32");
  const int64_t M = logits.size(0), E = logits.size(1), k = cfg.top_k;
  ANVIL_CHECK(k >= 1 && k <= E, "router: top_k ", k, " must be between 1 and the ", E, " experts");
  ANVIL_ASSERT(probs.shape() == logits.shape() && probs.dtype() == DType::f32, "router: probs ",
               shape_str(probs.shape()), " must match logits ", shape_str(logits.shape()));
  ANVIL_ASSERT(experts.shape() == Shape({M, k}) && experts.dtype() == DType::i32 && weights.shape() == Shape({M, k}) &&
                   weights.dtype() == DType::f32,
               "router: experts ", shape_str(experts.shape()), " (i32) and weights ", shape_str(weights.shape()),
               " (f32) must be (", M, ", ", k, ")");
  const ScopedOpTime op("moe.router.forward");
  if (dry_run()) return;
  const float* x = logits.data<float>();
  float* p = probs.data<float>();
  int32_t* ex = experts.data<int32_t>();
  float* w = weights.data<float>();
  parallel_for(0, M, 64, [&](int64_t lo, int64_t hi) {
    std::vector<int32_t> order(static_cast<size_t>(E));
    for (int64_t t = lo; t < hi; ++t) {
      const float* xt = x + t * E;
      float* pt = p + t * E;
      if (cfg.sigmoid) {
        for (int64_t e = 0; e < E; ++e) pt[e] = static_cast<float>(1.0 / (1.0 + std::exp(-static_cast<double>(xt[e]))));
      } else {
        const float m = *std::max_element(xt, xt + E);
        double sum = 0;
        for (int64_t e = 0; e < E; ++e) sum += (pt[e] = std::exp(xt[e] - m));
        const float inv = static_cast<float>(1.0 / sum);
        for (int64_t e = 0; e < E; ++e) pt[e] *= inv;
      }
      if (cfg.balanced) {
        const int64_t p = balanced_position(cfg, t);
        for (int64_t j = 0; j < k; ++j) order[static_cast<size_t>(j)] = balanced_expert(p, j, k, E);
      } else {
        for (int64_t e = 0; e < E; ++e) order[static_cast<size_t>(e)] = static_cast<int32_t>(e);
        // Descending score (plus the bias, when given); equal ones in ascending expert index.
        const auto score = [&](int32_t e) { return cfg.bias ? pt[e] + cfg.bias[e] : pt[e]; };
        std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
          const float sa = score(a), sb = score(b);
          return sa > sb || (sa == sb && a < b);
        });
      }
      double chosen = 0;
      for (int64_t j = 0; j < k; ++j) chosen += pt[order[static_cast<size_t>(j)]];
      for (int64_t j = 0; j < k; ++j) {
        const int32_t e = order[static_cast<size_t>(j)];
        ex[t * k + j] = e;
        w[t * k + j] = cfg.normalize ? static_cast<float>(pt[e] / chosen) : pt[e];
      }
    }
  });
}

void router_backward(const Tensor& probs, const Tensor& experts, const Tensor& dweights, const RouterConfig& cfg,
                     Tensor& dlogits, bool accumulate) {
  const auto [M, E, k] = check_probs(probs, experts, "router backward");
  ANVIL_ASSERT(dweights.shape() == experts.shape() && dweights.dtype() == DType::f32, "router backward: dweights ",
               shape_str(dweights.shape()), " must be f32 ", shape_str(experts.shape()));
  ANVIL_ASSERT(dlogits.shape() == probs.shape() && dlogits.dtype() == DType::f32, "router backward: dlogits ",
               shape_str(dlogits.shape()), " must be f32 ", shape_str(probs.shape()));
  const ScopedOpTime op("moe.router.backward");
  if (dry_run()) return;
  const float* p = probs.data<float>();
  const int32_t* ex = experts.data<int32_t>();
  const float* dw = dweights.data<float>();
  float* dx = dlogits.data<float>();
  parallel_for(0, M, 64, [&](int64_t lo, int64_t hi) {
    std::vector<double> dp(static_cast<size_t>(E));
    for (int64_t t = lo; t < hi; ++t) {
      const float* pt = p + t * E;
      std::fill(dp.begin(), dp.end(), 0.0);
      // Through the weights: w_j = p_j / s (s the chosen experts' sum) or p_j.
      double s = 0, dw_w = 0;
      for (int64_t j = 0; j < k; ++j) s += pt[ex[t * k + j]];
      for (int64_t j = 0; j < k; ++j) dw_w += dw[t * k + j] * pt[ex[t * k + j]] / s;
      for (int64_t j = 0; j < k; ++j) {
        const int32_t e = ex[t * k + j];
        dp[static_cast<size_t>(e)] += cfg.normalize ? (dw[t * k + j] - dw_w) / s : dw[t * k + j];
      }
      // Through the sigmoids, dx_e = dp_e p_e (1 − p_e), or the softmax, dx_e = p_e (dp_e − Σ_f p_f dp_f).
      double pdp = 0;
      if (!cfg.sigmoid)
        for (int64_t e = 0; e < E; ++e) pdp += pt[e] * dp[static_cast<size_t>(e)];
      for (int64_t e = 0; e < E; ++e) {
        const double d = dp[static_cast<size_t>(e)];
        const float g = static_cast<float>(cfg.sigmoid ? d * pt[e] * (1.0 - pt[e]) : pt[e] * (d - pdp));
        dx[t * E + e] = accumulate ? dx[t * E + e] + g : g;
      }
    }
  });
}

namespace {
// Each token's share of expert e: its probability, or its sigmoid score over the sum of its scores.
double score_sum(const float* pt, int64_t E) {
  double s = 0;
  for (int64_t e = 0; e < E; ++e) s += pt[e];
  return s;
}
}  // namespace

void router_aux_sums(const Tensor& probs, const Tensor& experts, bool sigmoid, RouterAuxSums& sums) {
  const auto [M, E, k] = check_probs(probs, experts, "router aux sums");
  if (sums.chose.empty())
    sums.chose.assign(static_cast<size_t>(E), 0.0), sums.share.assign(static_cast<size_t>(E), 0.0);
  ANVIL_ASSERT(static_cast<int64_t>(sums.chose.size()) == E, "router aux sums of ", sums.chose.size(), " experts, not ",
               E);
  const ScopedOpTime op("moe.router.aux_sums");
  if (dry_run()) return;
  const float* p = probs.data<float>();
  const int32_t* ex = experts.data<int32_t>();
  // In a fixed order: the result does not depend on the threads.
  for (int64_t t = 0; t < M; ++t) {
    for (int64_t j = 0; j < k; ++j) sums.chose[static_cast<size_t>(ex[t * k + j])] += 1;
    const double inv = sigmoid ? 1.0 / score_sum(p + t * E, E) : 1.0;
    for (int64_t e = 0; e < E; ++e) sums.share[static_cast<size_t>(e)] += p[t * E + e] * inv;
  }
  sums.tokens += static_cast<double>(M);
}

double router_aux_loss(const RouterAuxSums& sums) {
  if (sums.tokens == 0) return 0.0;
  const double M = sums.tokens;
  double loss = 0;
  for (size_t e = 0; e < sums.chose.size(); ++e) loss += sums.chose[e] / M * sums.share[e] / M;
  return loss * static_cast<double>(sums.chose.size());
}

void router_aux_backward(const Tensor& probs, const RouterAuxSums& sums, float coef, Tensor& dlogits, bool sigmoid) {
  ANVIL_ASSERT(dlogits.shape() == probs.shape() && dlogits.dtype() == DType::f32 && probs.dtype() == DType::f32 &&
                   probs.ndim() == 2 && static_cast<int64_t>(sums.chose.size()) == probs.size(1),
               "router aux backward: dlogits ", shape_str(dlogits.shape()), " must be f32 ", shape_str(probs.shape()),
               " over ", sums.chose.size(), " experts");
  const ScopedOpTime op("moe.router.aux_backward");
  const int64_t M = probs.size(0), E = probs.size(1);
  if (dry_run() || M == 0 || sums.tokens == 0) return;
  // dloss/dshare_{t,e} = E · n_e / M² (c_e), then through each token's softmax, or through its
  // normalisation q_e = p_e / S and the sigmoids: dp_e = (c_e − Σ_f c_f q_f) / S, dx_e = dp_e p_e (1 − p_e).
  const double Md = sums.tokens, Ed = static_cast<double>(E);
  const float* p = probs.data<float>();
  float* dx = dlogits.data<float>();
  parallel_for(0, M, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const float* pt = p + t * E;
      const double S = sigmoid ? score_sum(pt, E) : 1.0;
      double cq = 0;
      for (int64_t e = 0; e < E; ++e) cq += pt[e] / S * Ed * sums.chose[static_cast<size_t>(e)] / (Md * Md);
      for (int64_t e = 0; e < E; ++e) {
        const double c = Ed * sums.chose[static_cast<size_t>(e)] / (Md * Md);
        const double g = sigmoid ? (c - cq) / S * pt[e] * (1.0 - pt[e]) : pt[e] * (c - cq);
        dx[t * E + e] += static_cast<float>(coef * g);
      }
    }
  });
}

double router_aux_loss(const Tensor& probs, const Tensor& experts, float coef, Tensor* dlogits, bool sigmoid) {
  check_probs(probs, experts, "router aux loss");
  if (dry_run() || probs.size(0) == 0) return 0.0;
  RouterAuxSums sums;
  router_aux_sums(probs, experts, sigmoid, sums);
  if (dlogits != nullptr) router_aux_backward(probs, sums, coef, *dlogits, sigmoid);
  return router_aux_loss(sums);
}

}  // namespace anvil
