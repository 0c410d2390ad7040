// The mixture-of-experts feed-forward layer (model/moe_feed_forward.h): its
// output and auxiliary loss against a double-precision reference written from
// the Qwen3-MoE definition, its gradients (x, router, the experts' weights,
// through the aux loss too) against central differences of that reference
// with the experts fixed, for top-1, top-2 and top-4; every token on one
// expert; bf16 against the same reference.
#include "anvil/model/moe_feed_forward.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "test_util.h"

namespace {

using namespace anvil;
using namespace anvil::testing;

constexpr int64_t M = 10, D = 12, F = 8, E = 5;
constexpr double kAuxCoef = 0.3;

struct Doubles {
  std::vector<double> x, router, w1, w3, w2;
};

// The layer in double: Σ_j weight_j · W2[e_j] (silu(W1[e_j] x) ⊙ W3[e_j] x) per
// token, the experts e given (chosen by Anvil, checked against the double
// top-k below), the weights from the double softmax. Returns Σ y·r +
// aux_coef · aux, and the output, the probabilities and the aux loss.
struct Forward {
  double loss, aux;
  std::vector<double> y, probs;
};
Forward reference(const Doubles& p, const std::vector<int32_t>& experts, int64_t k, bool normalize,
                  const std::vector<double>& r) {
  Forward out{0, 0, std::vector<double>(M * D, 0.0), std::vector<double>(M * E)};
  std::vector<double> load(E, 0.0), mean_prob(E, 0.0);
  for (int64_t t = 0; t < M; ++t) {
    const double* x = &p.x[t * D];
    std::vector<double> logit(E);
    for (int64_t e = 0; e < E; ++e) logit[e] = std::inner_product(x, x + D, &p.router[e * D], 0.0);
    const double mx = *std::max_element(logit.begin(), logit.end());
    double z = 0;
    for (int64_t e = 0; e < E; ++e) z += std::exp(logit[e] - mx);
    for (int64_t e = 0; e < E; ++e) out.probs[t * E + e] = std::exp(logit[e] - mx) / z;
    double chosen = 0;
    for (int64_t j = 0; j < k; ++j) chosen += out.probs[t * E + experts[t * k + j]];
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = experts[t * k + j];
      const double weight = out.probs[t * E + e] / (normalize ? chosen : 1.0);
      load[e] += 1.0;
      std::vector<double> s(F);
      for (int64_t f = 0; f < F; ++f) {
        const double g = std::inner_product(x, x + D, &p.w1[(e * F + f) * D], 0.0);
        const double u = std::inner_product(x, x + D, &p.w3[(e * F + f) * D], 0.0);
        s[f] = g / (1 + std::exp(-g)) * u;
      }
      for (int64_t d = 0; d < D; ++d)
        out.y[t * D + d] += weight * std::inner_product(s.begin(), s.end(), &p.w2[(e * D + d) * F], 0.0);
    }
    for (int64_t e = 0; e < E; ++e) mean_prob[e] += out.probs[t * E + e] / M;
  }
  for (int64_t e = 0; e < E; ++e) out.aux += E * (load[e] / M) * mean_prob[e];
  out.loss = weighted_sum(out.y, r) + kAuxCoef * out.aux;
  return out;
}

// Token t's probability of expert e in double.
double want_probs(const Doubles& p, int64_t t, int64_t e) {
  std::vector<double> logit(E);
  for (int64_t f = 0; f < E; ++f) logit[f] = std::inner_product(&p.x[t * D], &p.x[t * D] + D, &p.router[f * D], 0.0);
  const double mx = *std::max_element(logit.begin(), logit.end());
  double z = 0;
  for (double l : logit) z += std::exp(l - mx);
  return std::exp(logit[e] - mx) / z;
}

struct Layer {
  Tensor x;
  MoeWeights w;
};
Layer random_layer(DType dt, const std::string& tag, float router_scale) {
  return {random_tensor({M, D}, dt, tag + ".x"),
          {random_tensor({E, D}, dt, tag + ".router", router_scale), random_tensor({E, F, D}, dt, tag + ".w1"),
           random_tensor({E, F, D}, dt, tag + ".w3"), random_tensor({E, D, F}, dt, tag + ".w2")}};
}
Doubles doubles_of(const Layer& l) {
  return {to_double(l.x), to_double(l.w.router), to_double(l.w.w1), to_double(l.w.w3), to_double(l.w.w2)};
}

// The experts the double probabilities rank first (ties to the lower index).
std::vector<int32_t> double_top_k(const std::vector<double>& probs, int64_t k) {
  std::vector<int32_t> out;
  for (int64_t t = 0; t < M; ++t) {
    std::vector<int32_t> idx(E);
    std::iota(idx.begin(), idx.end(), 0);
    std::stable_sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) { return probs[t * E + a] > probs[t * E + b]; });
    out.insert(out.end(), idx.begin(), idx.begin() + k);
  }
  return out;
}

// The weights' gradients, zeroed (moe_backward adds into them), and dy from r.
MoeWeights zero_grads() {
  return {Tensor::zeros({E, D}, DType::f32, MemCategory::workspace, "g.router"),
          Tensor::zeros({E, F, D}, DType::f32, MemCategory::workspace, "g.w1"),
          Tensor::zeros({E, F, D}, DType::f32, MemCategory::workspace, "g.w3"),
          Tensor::zeros({E, D, F}, DType::f32, MemCategory::workspace, "g.w2")};
}
Tensor dy_of(const std::vector<double>& r) {
  Tensor dy = Tensor::empty({M, D}, DType::f32, MemCategory::workspace, "dy");
  from_double(dy, r);
  return dy;
}

void check_layer(int64_t k, bool normalize) {
  SCOPED_TRACE("top-" + std::to_string(k) + (normalize ? ", renormalised" : ""));
  const RouterConfig cfg{k, normalize};
  const Layer l = random_layer(DType::f32, "moe" + std::to_string(k), 1.0f);
  const Doubles p = doubles_of(l);
  const std::vector<double> r = to_double(random_tensor({M, D}, DType::f32, "moe.r"));

  MoeSaved saved;
  const Tensor y = moe_forward(l.x, l.w, cfg, saved);
  const std::vector<int32_t> experts(saved.experts.data<int32_t>(), saved.experts.data<int32_t>() + M * k);
  const Forward want = reference(p, experts, k, normalize, r);
  EXPECT_EQ(experts, double_top_k(want.probs, k)) << "the f32 router chose other experts than the double one";
  EXPECT_LT(rel_error(y, want.y), 1e-6);
  EXPECT_NEAR(saved.aux_loss, want.aux, 1e-6 * want.aux);

  MoeWeights grads = zero_grads();
  Tensor dy = dy_of(r);
  Tensor dx = Tensor::empty({M, D}, DType::f32, MemCategory::workspace, "dx");
  moe_backward(dy, l.x, l.w, cfg, static_cast<float>(kAuxCoef), saved, dx, grads);

  // Central differences of the double layer, experts fixed.
  const auto numeric = [&](std::vector<double> Doubles::*field) {
    return numerical_grad(
        [&](const std::vector<double>& v) {
          Doubles q = p;
          q.*field = v;
          return reference(q, experts, k, normalize, r).loss;
        },
        p.*field, 1e-4);
  };
  const struct {
    const char* name;
    const Tensor& got;
    std::vector<double> Doubles::*field;
  } cases[] = {{"x", dx, &Doubles::x},
               {"router", grads.router, &Doubles::router},
               {"w1", grads.w1, &Doubles::w1},
               {"w3", grads.w3, &Doubles::w3},
               {"w2", grads.w2, &Doubles::w2}};
  for (const auto& c : cases) {
    const std::vector<double> want = numeric(c.field);
    double e = rel_error(c.got, want);
    std::printf("top-%lld%s: gradient of %s within %.2e of central differences\n", static_cast<long long>(k),
                normalize ? "" : " (not renormalised)", c.name, e);
    if (k == 1 && normalize && c.field == &Doubles::router) {
      // The weights are all 1, so the router learns from the aux loss alone:
      // aux_coef · p_e (c_e − Σ_f p_f c_f) per token, c_e = E·n_e/M², whose
      // terms cancel (5-fold here). Its error is measured against the terms'
      // size, ‖the router's gradient if Σ_f p_f c_f were 0‖, which f32
      // rounding of the probabilities and of the products bounds.
      std::vector<double> terms(static_cast<size_t>(E * D), 0.0);
      std::vector<double> n(E, 0.0);
      for (int32_t ex : experts) n[static_cast<size_t>(ex)] += 1;
      for (int64_t t = 0; t < M; ++t)
        for (int64_t e2 = 0; e2 < E; ++e2)
          for (int64_t d = 0; d < D; ++d)
            terms[static_cast<size_t>(e2 * D + d)] +=
                kAuxCoef * want_probs(p, t, e2) * E * n[static_cast<size_t>(e2)] / (M * M) * p.x[t * D + d];
      double norm_terms = 0, norm_want = 0;
      for (double v : terms) norm_terms += v * v;
      for (double v : want) norm_want += v * v;
      e *= std::sqrt(norm_want / norm_terms);
      std::printf("  (the aux loss's terms are %.0fx its gradient; against them %.2e)\n",
                  std::sqrt(norm_terms / norm_want), e);
    }
    // f32 sums against double differences with steps of 1e-4: ~1e-7 and ~1e-8.
    EXPECT_LT(e, 2e-6) << c.name;
  }
}

TEST(MoeFeedForward, Top1MatchesTheDoubleLayerAndItsDifferences) { check_layer(1, true); }
TEST(MoeFeedForward, Top2MatchesTheDoubleLayerAndItsDifferences) { check_layer(2, true); }
TEST(MoeFeedForward, Top4NotRenormalisedMatchesTheDoubleLayerAndItsDifferences) { check_layer(4, false); }

// Dropless: a router that sends every token to expert 3 (its row dominating
// every logit) still runs every token through it, and its gradients match.
TEST(MoeFeedForward, EveryTokenOnOneExpert) {
  Layer l = random_layer(DType::f32, "moe.one", 0.01f);
  for (int64_t d = 0; d < D; ++d) l.w.router.data<float>()[3 * D + d] = 0.0f;
  for (int64_t t = 0; t < M; ++t) l.x.data<float>()[t * D] = 1.0f + 0.1f * static_cast<float>(t);
  l.w.router.data<float>()[3 * D] = 50.0f;  // logit 50·x[0] > 50 for expert 3, ≈ 0 for the others
  MoeSaved saved;
  const Tensor y = moe_forward(l.x, l.w, RouterConfig{1, true}, saved);
  EXPECT_EQ(saved.routes.rows(3), M);
  const std::vector<double> r = to_double(random_tensor({M, D}, DType::f32, "moe.one.r"));
  const std::vector<int32_t> all_on_3(M, 3);
  const Doubles p = doubles_of(l);
  const Forward want = reference(p, all_on_3, 1, true, r);
  EXPECT_LT(rel_error(y, want.y), 1e-6);

  // The backward through the one expert: the input's and the experts'
  // gradients against central differences of the double layer (the other
  // experts' exactly 0 on both sides). The router's is the aux loss's alone
  // through probabilities within e^-40 of one-hot, so it is held absolutely.
  MoeWeights grads = zero_grads();
  Tensor dy = dy_of(r);
  Tensor dx = Tensor::empty({M, D}, DType::f32, MemCategory::workspace, "dx");
  moe_backward(dy, l.x, l.w, RouterConfig{1, true}, static_cast<float>(kAuxCoef), saved, dx, grads);
  const auto numeric = [&](std::vector<double> Doubles::*field) {
    return numerical_grad(
        [&](const std::vector<double>& v) {
          Doubles q = p;
          q.*field = v;
          return reference(q, all_on_3, 1, true, r).loss;
        },
        p.*field, 1e-4);
  };
  EXPECT_LT(rel_error(dx, numeric(&Doubles::x)), 2e-6) << "x";
  EXPECT_LT(rel_error(grads.w1, numeric(&Doubles::w1)), 2e-6) << "w1";
  EXPECT_LT(rel_error(grads.w3, numeric(&Doubles::w3)), 2e-6) << "w3";
  EXPECT_LT(rel_error(grads.w2, numeric(&Doubles::w2)), 2e-6) << "w2";
  const std::vector<double> router = to_double(grads.router), router_want = numeric(&Doubles::router);
  for (size_t i = 0; i < router.size(); ++i) EXPECT_NEAR(router[i], router_want[i], 1e-9) << "router " << i;
  for (int64_t e = 0; e < E; ++e) {
    if (e == 3) continue;
    for (int64_t i = 0; i < F * D; ++i) ASSERT_EQ(grads.w1.data<float>()[e * F * D + i], 0.0f) << "expert " << e;
  }
}

// bf16 storage: the same layer, every product's output rounded to bf16 (2^-9
// relative) a few times over, against the double reference.
TEST(MoeFeedForward, Bf16StaysWithinItsRounding) {
  const Layer l = random_layer(DType::bf16, "moe.bf16", 1.0f);
  const RouterConfig cfg{2, true};
  MoeSaved saved;
  const Tensor y = moe_forward(l.x, l.w, cfg, saved);
  const std::vector<int32_t> experts(saved.experts.data<int32_t>(), saved.experts.data<int32_t>() + M * 2);
  const Forward want = reference(doubles_of(l), experts, 2, true, std::vector<double>(M * D, 0.0));
  const double e = rel_error(y, want.y);
  std::printf("bf16: output within %.2e of the double layer\n", e);
  EXPECT_LT(e, 1e-2);
}

}  // namespace
