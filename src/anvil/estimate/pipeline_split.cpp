#include "anvil/estimate/pipeline_split.h"

#include <algorithm>
#include <limits>

#include "anvil/core/error.h"

namespace anvil {

std::vector<ModuleCost> pipeline_module_costs(const ModelArgs& args, const TrainShape& shape) {
  const double M = static_cast<double>(shape.local_batch_size * shape.seq_len), D = static_cast<double>(args.dim);
  const double V = static_cast<double>(args.vocab_size), e = shape.compute_dtype == DType::bf16 ? 2 : 4;
  // Per parameter: fp32 master, gradient and two AdamW moments, and a bf16 compute copy.
  const double state = 16 + (shape.compute_dtype == DType::bf16 ? 2 : 0);
  std::vector<ModuleCost> out;
  out.push_back({2 * M * D, 0, 4 * M * D, V * D * state, 0});  // the embedding: a gather, a scatter-add of M rows
  const double block_params = static_cast<double>(args.params_per_layer());
  // The matrix products 6 FLOPs per weight per token, attention's scores and
  // weighted sum 12·heads·head_dim·seq per token (as estimate/flops.h counts them).
  const double attention = 12.0 * static_cast<double>(args.n_heads * args.head_dim() * shape.seq_len);
  for (int l = 0; l < args.n_layers; ++l) {
    // A third each: the forward, the input gradient (attention's backward is
    // counted there), the weight gradient; full checkpointing runs the forward
    // again before the input gradient.
    const double third = M * (6 * block_params + attention) / 3;
    const double recompute = shape.ac.recomputes_whole_block(l) ? third : 0;
    out.push_back({third, third + recompute, third, block_params * state,
                   static_cast<double>(block_saved_bytes(args, shape, l))});
  }
  // The head: the output projection's forward and both gradients, all in its
  // fused pass (I); it keeps its input from the forward.
  const double head_params = D + (args.tie_embeddings ? 0 : V * D);
  out.push_back({0, 6 * M * V * D, 0, head_params * state, M * D * e});
  return out;
}

std::vector<int> balanced_pipeline_cut(const std::vector<ModuleCost>& costs, const std::vector<int>& in_flight) {
  const int n = static_cast<int>(costs.size()), S = static_cast<int>(in_flight.size());
  ANVIL_CHECK(S >= 1 && S <= n, "the model's ", n, " modules cannot fill ", S, " pipeline stages");
  double flops = 0, bytes = 0, mean_in_flight = 0;
  for (int k : in_flight) mean_in_flight += static_cast<double>(k) / S;
  for (const ModuleCost& c : costs) flops += c.flops(), bytes += c.weight_bytes + c.activation_bytes * mean_in_flight;
  // Prefix sums, so a stage's totals are two subtractions.
  std::vector<double> pf(n + 1, 0), pw(n + 1, 0), pa(n + 1, 0);
  for (int i = 0; i < n; ++i) {
    pf[i + 1] = pf[i] + costs[i].flops();
    pw[i + 1] = pw[i] + costs[i].weight_bytes;
    pa[i + 1] = pa[i] + costs[i].activation_bytes;
  }
  auto share = [&](double part, double total) { return total > 0 ? part / (total / S) : 0.0; };
  auto stage_cost = [&](int s, int first, int end) {
    const double c = share(pf[end] - pf[first], flops);
    const double m = share(pw[end] - pw[first] + (pa[end] - pa[first]) * in_flight[s], bytes);
    return std::max(c, m);
  };
  // best[s][j]: the least largest cost of stages 0..s−1 holding modules [0, j).
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(S + 1, std::vector<double>(n + 1, inf));
  std::vector<std::vector<int>> cut(S + 1, std::vector<int>(n + 1, 0));
  best[0][0] = 0;
  for (int s = 1; s <= S; ++s)
    for (int j = s; j <= n - (S - s); ++j)
      for (int i = s - 1; i < j; ++i) {
        const double v = std::max(best[s - 1][i], stage_cost(s - 1, i, j));
        if (v < best[s][j]) best[s][j] = v, cut[s][j] = i;
      }
  std::vector<int> first(S);
  for (int s = S, j = n; s >= 1; --s) j = first[s - 1] = cut[s][j];
  return first;
}

}  // namespace anvil
