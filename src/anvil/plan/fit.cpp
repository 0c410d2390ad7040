#include "anvil/plan/fit.h"

namespace anvil {

MemoryEstimate shard_model_state(MemoryEstimate est, int64_t shards) {
  if (shards <= 1) return est;
  for (MemCategory c : {MemCategory::parameters, MemCategory::gradients, MemCategory::optimizer_state}) {
    const size_t full = est.bytes(c), sharded = (full + static_cast<size_t>(shards) - 1) / static_cast<size_t>(shards);
    est.peak[static_cast<int>(c)] = sharded;
    est.peak_total -= full - sharded;
  }
  return est;
}

int64_t fsdp_ranks_to_fit(const ModelArgs& args, const TrainShape& shape, size_t available) {
  const MemoryEstimate est = estimate_memory(args, shape);
  // The estimate falls as 1/N towards the activations and workspace: a
  // doubling search for a fitting N, then bisection for the fewest.
  constexpr int64_t kMaxRanks = int64_t{1} << 20;
  int64_t hi = 1;
  while (hi <= kMaxRanks && shard_model_state(est, hi).peak_total > available) hi *= 2;
  if (hi > kMaxRanks) return 0;
  int64_t lo = hi / 2;  // does not fit (or is 0)
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    (shard_model_state(est, mid).peak_total > available ? lo : hi) = mid;
  }
  return hi;
}

}  // namespace anvil
