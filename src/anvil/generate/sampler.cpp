#include "anvil/generate/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "anvil/core/error.h"
#include "anvil/core/rng.h"

namespace anvil {

void check_sampling_options(const SamplingOptions& o) {
  ANVIL_CHECK(o.temperature >= 0, "--temperature ", o.temperature, " is negative; 0 is greedy");
  ANVIL_CHECK(o.top_k >= 0, "--top_k ", o.top_k, " is negative; 0 keeps every token");
  ANVIL_CHECK(o.top_p > 0 && o.top_p <= 1, "--top_p ", o.top_p, " is outside (0, 1]; 1 keeps every token");
}

int32_t sample_token(const float* logits, int64_t V, const SamplingOptions& o, float u) {
  check_sampling_options(o);
  ANVIL_ASSERT(V > 0, "no logits");
  if (o.temperature == 0 || o.top_k == 1)
    return static_cast<int32_t>(std::max_element(logits, logits + V) - logits);  // the first maximum
  // The candidates, most likely first (ties by id, so the order is defined).
  const int64_t k = o.top_k == 0 ? V : std::min(o.top_k, V);
  std::vector<int32_t> ids(static_cast<size_t>(V));
  std::iota(ids.begin(), ids.end(), 0);
  auto higher = [&](int32_t a, int32_t b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); };
  std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), higher);
  ids.resize(static_cast<size_t>(k));
  // Softmax at the temperature, in double, from the largest logit down.
  std::vector<double> p(ids.size());
  const double top = logits[ids[0]];
  double sum = 0;
  for (size_t i = 0; i < ids.size(); ++i) sum += p[i] = std::exp((logits[ids[i]] - top) / o.temperature);
  // The nucleus: the smallest prefix whose probability reaches top_p.
  size_t keep = ids.size();
  if (o.top_p < 1) {
    double mass = 0;
    for (size_t i = 0; i < ids.size(); ++i) {
      mass += p[i] / sum;
      if (mass >= o.top_p) {
        keep = i + 1;
        break;
      }
    }
  }
  const double kept = std::accumulate(p.begin(), p.begin() + static_cast<std::ptrdiff_t>(keep), 0.0);
  double target = static_cast<double>(u) * kept, acc = 0;
  for (size_t i = 0; i < keep; ++i) {
    acc += p[i];
    if (target < acc) return ids[i];
  }
  return ids[keep - 1];  // u within rounding of 1
}

float sampling_draw(uint64_t seed, int64_t sequence, int64_t step) {
  const uint64_t key = RngStream{seed, "generate.sample"}.key();
  return uniform01(key, (static_cast<uint64_t>(sequence) << 32) + static_cast<uint64_t>(step));
}

}  // namespace anvil
