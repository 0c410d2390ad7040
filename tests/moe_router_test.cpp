// Mixture-of-experts routing (ops/moe_router.h) against a double-precision
// reference of Qwen3-MoE's routing and Hugging Face's load-balancing loss,
// the backward against central differences of that reference, and the
// tie rule every implementation must share.
#include "anvil/ops/moe_router.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <vector>

#include "anvil/core/dry_run.h"
#include "anvil/core/rng.h"
#include "anvil/ops/moe_dispatch.h"
#include "oracles.h"
#include "test_util.h"

namespace {

using namespace anvil;
using namespace anvil::testing;

struct RefRouting {
  std::vector<double> probs;   // (M, E)
  std::vector<int32_t> experts;  // (M, k)
  std::vector<double> weights;   // (M, k)
};

// Softmax (or sigmoid) scores, top-k by score plus bias (ties to the lower
// index), weights the chosen scores renormalised or not.
RefRouting ref_route(const std::vector<double>& x, int64_t M, int64_t E, int64_t k, bool normalize,
                     const std::vector<int32_t>* fixed_experts = nullptr, bool sigmoid = false,
                     const std::vector<double>* bias = nullptr) {
  RefRouting r{std::vector<double>(x.size()), std::vector<int32_t>(size_t(M * k)), std::vector<double>(size_t(M * k))};
  for (int64_t t = 0; t < M; ++t) {
    if (sigmoid) {
      for (int64_t e = 0; e < E; ++e) r.probs[size_t(t * E + e)] = 1.0 / (1.0 + std::exp(-x[size_t(t * E + e)]));
    } else {
      const double m = *std::max_element(x.begin() + t * E, x.begin() + (t + 1) * E);
      double sum = 0;
      for (int64_t e = 0; e < E; ++e) sum += (r.probs[size_t(t * E + e)] = std::exp(x[size_t(t * E + e)] - m));
      for (int64_t e = 0; e < E; ++e) r.probs[size_t(t * E + e)] /= sum;
    }
    std::vector<int32_t> order(static_cast<size_t>(E));
    std::iota(order.begin(), order.end(), 0);
    const double* p = r.probs.data() + t * E;
    const auto score = [&](int32_t e) { return p[e] + (bias ? (*bias)[size_t(e)] : 0.0); };
    std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return score(a) > score(b); });
    double chosen = 0;
    for (int64_t j = 0; j < k; ++j) {
      const int32_t e = fixed_experts ? (*fixed_experts)[size_t(t * k + j)] : order[size_t(j)];
      r.experts[size_t(t * k + j)] = e;
      chosen += p[e];
    }
    for (int64_t j = 0; j < k; ++j)
      r.weights[size_t(t * k + j)] = normalize ? p[r.experts[size_t(t * k + j)]] / chosen : p[r.experts[size_t(t * k + j)]];
  }
  return r;
}

// Hugging Face's load_balancing_loss_func for one layer: E · Σ_e (n_e / M) · mean_t p_{t,e};
// under sigmoid scores p_{t,e} is token t's score of e over the sum of its scores (DeepSeek-V3's).
double ref_aux(const RefRouting& r, int64_t M, int64_t E, int64_t k, bool sigmoid = false) {
  double loss = 0;
  for (int64_t e = 0; e < E; ++e) {
    double n = 0, mean = 0;
    for (int64_t t = 0; t < M; ++t) {
      for (int64_t j = 0; j < k; ++j) n += r.experts[size_t(t * k + j)] == e;
      double sum = 1;
      if (sigmoid) sum = std::accumulate(r.probs.begin() + t * E, r.probs.begin() + (t + 1) * E, 0.0);
      mean += r.probs[size_t(t * E + e)] / sum;
    }
    loss += n / double(M) * mean / double(M);
  }
  return double(E) * loss;
}

// Logits whose probabilities are well apart within each token (a random
// permutation of spaced values, plus a little noise), so that central
// differences never change which experts a token picks.
Tensor spaced_logits(int64_t M, int64_t E, uint64_t seed) {
  Tensor x = Tensor::empty({M, E}, DType::f32, MemCategory::workspace, "logits");
  const uint64_t key = RngStream{seed, "router.logits"}.key();
  for (int64_t t = 0; t < M; ++t) {
    std::vector<int> perm(static_cast<size_t>(E));
    std::iota(perm.begin(), perm.end(), 0);
    for (int64_t e = E - 1; e > 0; --e)
      std::swap(perm[size_t(e)], perm[size_t(uniform01(key, uint64_t(t * E + e)) * double(e + 1))]);
    for (int64_t e = 0; e < E; ++e)
      x.data<float>()[t * E + e] =
          0.3f * float(perm[size_t(e)]) + 0.05f * float(uniform01(key, uint64_t(M * E + t * E + e)));
  }
  return x;
}

struct Routed {
  Tensor probs, experts, weights;
};

Routed route(const Tensor& logits, const RouterConfig& cfg) {
  const int64_t M = logits.size(0), E = logits.size(1);
  Routed r{Tensor::empty({M, E}, DType::f32, MemCategory::workspace, "probs"),
           Tensor::empty({M, cfg.top_k}, DType::i32, MemCategory::workspace, "experts"),
           Tensor::empty({M, cfg.top_k}, DType::f32, MemCategory::workspace, "weights")};
  router_forward(logits, cfg, r.probs, r.experts, r.weights);
  return r;
}

// Top-1, top-2 and top-8 of 8 and 16 experts, renormalised and not.
TEST(MoeRouter, ForwardMatchesDoubleReference) {
  const int64_t M = 37;
  for (const int64_t E : {8, 16})
    for (const int64_t k : {1, 2, 8})
      for (const bool normalize : {true, false}) {
        const RouterConfig cfg{k, normalize};
        const Tensor x = random_tensor({M, E}, DType::f32, "logits", 3.0f);
        const Routed r = route(x, cfg);
        const RefRouting want = ref_route(to_double(x), M, E, k, normalize);
        const std::vector<int32_t> got(r.experts.data<int32_t>(), r.experts.data<int32_t>() + M * k);
        EXPECT_EQ(got, want.experts) << "E " << E << " k " << k;
        EXPECT_LT(rel_error(r.probs, want.probs), 1e-6);
        EXPECT_LT(rel_error(r.weights, want.weights), 1e-6);
        const double aux = router_aux_loss(r.probs, r.experts), want_aux = ref_aux(want, M, E, k);
        EXPECT_NEAR(aux, want_aux, 1e-6 * want_aux) << "E " << E << " k " << k;
      }
}

// Equal scores: the lower expert index wins, in order, so every side of a
// parity test picks the same experts. Uniform probabilities and every token on
// experts 0..k-1 make the auxiliary loss E · Σ_{e<k} 1 · (1/E) = k.
TEST(MoeRouter, TiesGoToTheLowerExpertAndTheAuxLossOfUniformScoresIsK) {
  const int64_t M = 5, E = 8, k = 3;
  const Tensor x = Tensor::zeros({M, E}, DType::f32, MemCategory::workspace, "logits");
  const Routed r = route(x, {k, true});
  for (int64_t t = 0; t < M; ++t)
    for (int64_t j = 0; j < k; ++j) {
      EXPECT_EQ(r.experts.data<int32_t>()[t * k + j], j);
      EXPECT_FLOAT_EQ(r.weights.data<float>()[t * k + j], 1.0f / 3);
    }
  EXPECT_NEAR(router_aux_loss(r.probs, r.experts), 3.0, 1e-12);
}

// The gradient of Σ dw · w + coef · aux with respect to the logits, against
// central differences of the double reference with the experts held (the
// spaced logits keep every choice under the step).
TEST(MoeRouter, BackwardMatchesFiniteDifferences) {
  const int64_t M = 6, E = 8;
  const float coef = 0.37f;
  for (const int64_t k : {1, 2, 8})
    for (const bool normalize : {true, false}) {
      const RouterConfig cfg{k, normalize};
      const Tensor x = spaced_logits(M, E, uint64_t(k) * 7 + normalize);
      const Tensor dw = random_tensor({M, k}, DType::f32, "dweights");
      const Routed r = route(x, cfg);
      Tensor dx = random_tensor({M, E}, DType::f32, "garbage", 100.0f);
      router_backward(r.probs, r.experts, dw, cfg, dx);
      (void)router_aux_loss(r.probs, r.experts, coef, &dx);
      const std::vector<int32_t> held(r.experts.data<int32_t>(), r.experts.data<int32_t>() + M * k);
      const std::vector<double> w = to_double(dw);
      const auto loss = [&](const std::vector<double>& xs) {
        const RefRouting ref = ref_route(xs, M, E, k, normalize, &held);
        double l = 0;
        for (size_t i = 0; i < w.size(); ++i) l += w[i] * ref.weights[i];
        // The aux loss counts the held choices; its gradient flows through the probabilities.
        return l + coef * ref_aux(ref, M, E, k);
      };
      const std::vector<double> num = numerical_grad(loss, to_double(x));
      const double e = rel_error(dx, num);
      std::printf("router k %lld %-12s dlogits %.2e against central differences\n", static_cast<long long>(k),
                  normalize ? "renormalised" : "raw", e);
      EXPECT_LT(e, 1e-5);
      // The routing the differences held is the routing the op made.
      EXPECT_EQ(ref_route(to_double(x), M, E, k, normalize).experts, held);
    }
}

// DeepSeek-V3's options: sigmoid scores (forward and aux loss against the
// reference, the backward against central differences) and an expert bias,
// which moves the choice of experts but not their weights.
TEST(MoeRouter, SigmoidScoresMatchTheReferenceAndTheirDifferences) {
  const int64_t M = 6, E = 8;
  const float coef = 0.37f;
  for (const int64_t k : {1, 2, 8}) {
    const RouterConfig cfg{.top_k = k, .normalize = true, .sigmoid = true};
    const Tensor x = spaced_logits(M, E, uint64_t(k) * 11);
    const Routed r = route(x, cfg);
    const RefRouting want = ref_route(to_double(x), M, E, k, true, nullptr, /*sigmoid=*/true);
    EXPECT_EQ(std::vector<int32_t>(r.experts.data<int32_t>(), r.experts.data<int32_t>() + M * k), want.experts);
    EXPECT_LT(rel_error(r.probs, want.probs), 1e-6);
    EXPECT_LT(rel_error(r.weights, want.weights), 1e-6);
    const double aux = router_aux_loss(r.probs, r.experts, 0.0f, nullptr, true);
    EXPECT_NEAR(aux, ref_aux(want, M, E, k, true), 1e-6 * aux);
    const Tensor dw = random_tensor({M, k}, DType::f32, "dweights");
    Tensor dx = random_tensor({M, E}, DType::f32, "garbage", 100.0f);
    router_backward(r.probs, r.experts, dw, cfg, dx);
    (void)router_aux_loss(r.probs, r.experts, coef, &dx, true);
    const std::vector<double> w = to_double(dw);
    const auto loss = [&](const std::vector<double>& xs) {
      const RefRouting ref = ref_route(xs, M, E, k, true, &want.experts, true);
      double l = 0;
      for (size_t i = 0; i < w.size(); ++i) l += w[i] * ref.weights[i];
      return l + coef * ref_aux(ref, M, E, k, true);
    };
    const double e = rel_error(dx, numerical_grad(loss, to_double(x)));
    std::printf("router sigmoid k %lld dlogits %.2e against central differences\n", static_cast<long long>(k), e);
    EXPECT_LT(e, 1e-5);
  }
  // A bias that lifts expert 7 above every score of these logits (scores 0.3 apart per rank
  // before the sigmoid) puts it first for every token, while the weights stay the scores'.
  const Tensor x = spaced_logits(M, E, 5);
  std::vector<float> bias(static_cast<size_t>(E), 0.0f);
  bias[7] = 1.0f;
  const RouterConfig biased{.top_k = 2, .normalize = true, .sigmoid = true, .bias = bias.data()};
  const Routed r = route(x, biased);
  const std::vector<double> bias_d(bias.begin(), bias.end());
  const RefRouting want = ref_route(to_double(x), M, E, 2, true, nullptr, true, &bias_d);
  EXPECT_EQ(std::vector<int32_t>(r.experts.data<int32_t>(), r.experts.data<int32_t>() + M * 2), want.experts);
  EXPECT_LT(rel_error(r.weights, want.weights), 1e-6);
  for (int64_t t = 0; t < M; ++t) EXPECT_EQ(r.experts.data<int32_t>()[t * 2], 7) << "token " << t;
}

// Accumulating adds the gradient to what dlogits holds.
TEST(MoeRouter, BackwardAccumulates) {
  const RouterConfig cfg{2, true};
  const Tensor x = spaced_logits(4, 8, 3);
  const Tensor dw = random_tensor({4, 2}, DType::f32, "dweights");
  const Routed r = route(x, cfg);
  Tensor once = Tensor::zeros({4, 8}, DType::f32, MemCategory::workspace, "once");
  router_backward(r.probs, r.experts, dw, cfg, once);
  Tensor twice = Tensor::zeros({4, 8}, DType::f32, MemCategory::workspace, "twice");
  router_backward(r.probs, r.experts, dw, cfg, twice, true);
  router_backward(r.probs, r.experts, dw, cfg, twice, true);
  std::vector<double> want = to_double(once);
  for (double& v : want) v *= 2;
  EXPECT_LT(max_abs_error(to_double(twice), want), 1e-7);
}

// A sequence in parts (context parallelism's chunks on several ranks): the
// parts' sums add up to the whole sequence's, its loss follows from them, and
// each part's gradient from the whole sums is the whole gradient's rows, for
// softmax and sigmoid scores alike.
TEST(MoeRouter, AuxLossSumsOfPartsAddUpToTheWholeSequences) {
  const int64_t M = 12, E = 8, k = 2;
  for (const bool sigmoid : {false, true}) {
    RouterConfig cfg{k, true};
    cfg.sigmoid = sigmoid;
    const Routed r = route(spaced_logits(M, E, 5 + sigmoid), cfg);
    Tensor whole = Tensor::zeros({M, E}, DType::f32, MemCategory::workspace, "whole");
    const double want = router_aux_loss(r.probs, r.experts, 0.5f, &whole, sigmoid);
    RouterAuxSums sums;  // rows [0, 5) and [5, 12), added in the other order
    router_aux_sums(r.probs.slice(5, 7), r.experts.slice(5, 7), sigmoid, sums);
    router_aux_sums(r.probs.slice(0, 5), r.experts.slice(0, 5), sigmoid, sums);
    EXPECT_EQ(sums.tokens, double(M));
    EXPECT_NEAR(router_aux_loss(sums), want, 1e-12 * want);
    const std::vector<int32_t> held(r.experts.data<int32_t>(), r.experts.data<int32_t>() + M * k);
    EXPECT_NEAR(want,
                ref_aux(ref_route(to_double(spaced_logits(M, E, 5 + sigmoid)), M, E, k, true, &held, sigmoid), M, E, k,
                        sigmoid),
                1e-6 * want);
    Tensor parts = Tensor::zeros({M, E}, DType::f32, MemCategory::workspace, "parts");
    for (const auto& [first, rows] : {std::pair<int64_t, int64_t>{0, 5}, std::pair<int64_t, int64_t>{5, 7}}) {
      Tensor d = parts.slice(first, rows);
      router_aux_backward(r.probs.slice(first, rows), sums, 0.5f, d, sigmoid);
    }
    EXPECT_EQ(to_double(parts), to_double(whole)) << (sigmoid ? "sigmoid" : "softmax");
  }
}

// The forced-balance rule routes per sequence, so sequences whose tokens × k
// leave a remainder over the experts give the first experts one more row per
// sequence, not one more in all. The dry run (which has no router output)
// takes the rule's counts, balanced_route_offsets, and they must be exactly
// what sort_routes makes of the real router's choices: for several
// sequences, with and without a remainder, whole and given by positions.
TEST(MoeRouter, TheDryRunsBalancedRoutesAreTheRoutersForEverySequenceLength) {
  struct Case {
    int64_t sequences, T, E, k;
  };
  for (const Case c : {Case{1, 33, 8, 2}, Case{3, 33, 8, 2}, Case{2, 5, 4, 3}, Case{4, 32, 8, 2}, Case{2, 7, 6, 1}}) {
    SCOPED_TRACE(::testing::Message() << c.sequences << " sequences of " << c.T << ", top-" << c.k << " of " << c.E);
    const int64_t M = c.sequences * c.T;
    const Tensor x = random_tensor({M, c.E}, DType::f32, "logits");
    Tensor p = Tensor::empty({M, c.E}, DType::f32, MemCategory::workspace, "p");
    Tensor ex = Tensor::empty({M, c.k}, DType::i32, MemCategory::workspace, "e");
    Tensor w = Tensor::empty({M, c.k}, DType::f32, MemCategory::workspace, "w");
    RouterConfig cfg{c.k, true, true, c.T};
    router_forward(x, cfg, p, ex, w);
    const ExpertRoutes real = sort_routes(ex, c.E);
    EXPECT_EQ(balanced_route_offsets(M, c.E, cfg), real.offsets);
    {
      DryRun dry;
      const Tensor dry_ex = Tensor::empty({M, c.k}, DType::i32, MemCategory::workspace, "e");
      EXPECT_EQ(sort_routes(dry_ex, c.E, balanced_route_offsets(M, c.E, cfg)).offsets, real.offsets);
    }
    // Positions given (the rows in another order): the same rule on them.
    std::vector<int64_t> positions(static_cast<size_t>(M));
    for (int64_t t = 0; t < M; ++t) positions[static_cast<size_t>(t)] = (t * 7 + 3) % c.T;
    cfg.positions = positions.data();
    router_forward(x, cfg, p, ex, w);
    EXPECT_EQ(balanced_route_offsets(M, c.E, cfg), sort_routes(ex, c.E).offsets);
    // One spread of all the routes over the experts, the dry run's earlier
    // assumption, is right only where each sequence's routes divide evenly.
    const bool remainder = (c.T * c.k) % c.E != 0 && c.sequences > 1;
    EXPECT_EQ(balanced_offsets(M * c.k, c.E) != real.offsets, remainder) << "the case shows the difference or not";
  }
}

TEST(MoeRouter, TopKBeyondTheExpertsIsAClearError) {
  const Tensor x = Tensor::zeros({2, 4}, DType::f32, MemCategory::workspace, "logits");
  Tensor p = Tensor::empty({2, 4}, DType::f32, MemCategory::workspace, "p");
  Tensor ex = Tensor::empty({2, 5}, DType::i32, MemCategory::workspace, "e");
  Tensor w = Tensor::empty({2, 5}, DType::f32, MemCategory::workspace, "w");
  try {
    router_forward(x, {5, true}, p, ex, w);
    FAIL() << "top_k 5 of 4 experts was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("top_k 5 must be between 1 and the 4 experts"), std::string::npos) << e.what();
  }
}

// The load-balancing loss against the code the loss was taken from:
// transformers' load_balancing_loss_func (modeling_qwen3_moe) for one layer
// over one sequence, in the oracles' environment (scripts/transformers_aux_loss.py).
// Both take the softmax and the top k in f32 and sum E · Σ_e (n_e / M) · P_e:
// within 1e-6 relative. Top-1, top-2 and top-8 of 8 and 16 experts, logits
// spread enough that the top k has no near-tie rounding could reorder.
TEST(MoeRouter, AuxLossIsTransformersLoadBalancingLoss) {
  ANVIL_NEED_ORACLES(python);
  const std::filesystem::path dir = scratch_root() / "moe_aux_loss";
  std::filesystem::create_directories(dir);
  const int64_t M = 61;
  std::vector<std::pair<std::string, double>> cases;  // (E and k, Anvil's loss)
  std::string cmd = "'" + python + "' " + ANVIL_SOURCE_DIR + "/scripts/transformers_aux_loss.py";
  for (const int64_t E : {8, 16})
    for (const int64_t k : {1, 2, 8}) {
      const Tensor x = random_tensor({M, E}, DType::f32, "logits", 3.0f);
      const Routed r = route(x, {k, true});
      cases.emplace_back("E " + std::to_string(E) + " top " + std::to_string(k), router_aux_loss(r.probs, r.experts));
      const std::filesystem::path logits = dir / ("logits_" + std::to_string(cases.size()) + ".f32");
      std::ofstream(logits, std::ios::binary)
          .write(static_cast<const char*>(x.raw()), static_cast<std::streamsize>(M * E * sizeof(float)));
      cmd += " --case " + logits.string() + ":" + std::to_string(M) + ":" + std::to_string(E) + ":" + std::to_string(k);
    }
  std::string out;
  ASSERT_EQ(shell_output(cmd, out), 0) << cmd << ":\n" << out;
  const std::vector<double> theirs = nlohmann::json::parse(out).at("aux").get<std::vector<double>>();
  ASSERT_EQ(theirs.size(), cases.size()) << out;
  for (size_t i = 0; i < cases.size(); ++i) {
    std::printf("%s: Anvil %.9f, transformers %.9f\n", cases[i].first.c_str(), cases[i].second, theirs[i]);
    EXPECT_NEAR(cases[i].second, theirs[i], 1e-6 * theirs[i]) << cases[i].first;
  }
}

}  // namespace
