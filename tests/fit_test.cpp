// What fits: sharding the model state over FSDP ranks, and the fewest ranks
// that fit a run one process cannot hold (what a refused run suggests).
#include <gtest/gtest.h>

#include "anvil/model/args.h"
#include "anvil/plan/fit.h"

namespace anvil {
namespace {

TrainShape shape_8b(AcMode mode) {
  TrainShape s;
  s.local_batch_size = 1;
  s.seq_len = 8192;
  s.compute_dtype = DType::bf16;
  s.ac.mode = mode;
  return s;
}

TEST(Fit, ShardingDividesTheModelStateAndNothingElse) {
  const ModelArgs args = model_flavor("llama3", "8B");
  const MemoryEstimate whole = estimate_memory(args, shape_8b(AcMode::full));
  const MemoryEstimate quarter = shard_model_state(whole, 4);
  for (MemCategory c : {MemCategory::parameters, MemCategory::gradients, MemCategory::optimizer_state})
    EXPECT_EQ(quarter.bytes(c), (whole.bytes(c) + 3) / 4) << category_name(c);
  EXPECT_EQ(quarter.bytes(MemCategory::activations), whole.bytes(MemCategory::activations));
  EXPECT_EQ(quarter.bytes(MemCategory::workspace), whole.bytes(MemCategory::workspace));
  EXPECT_EQ(quarter.peak_total, whole.peak_total - (whole.bytes(MemCategory::parameters) +
                                                    whole.bytes(MemCategory::gradients) +
                                                    whole.bytes(MemCategory::optimizer_state)) +
                                    quarter.bytes(MemCategory::parameters) + quarter.bytes(MemCategory::gradients) +
                                    quarter.bytes(MemCategory::optimizer_state));
}

TEST(Fit, TheFewestFsdpRanksFitAndOneFewerDoesNot) {
  const ModelArgs args = model_flavor("llama3", "8B");
  const size_t available = size_t{24} << 30;
  for (AcMode mode : {AcMode::none, AcMode::selective_op, AcMode::full}) {
    const TrainShape s = shape_8b(mode);
    const MemoryEstimate est = estimate_memory(args, s);
    const int64_t n = fsdp_ranks_to_fit(args, s, available);
    if (est.bytes(MemCategory::activations) + est.bytes(MemCategory::workspace) >= available) {
      EXPECT_EQ(n, 0) << ac_mode_name(mode) << ": activations alone exceed the memory, no rank count helps";
      continue;
    }
    ASSERT_GT(n, 1) << ac_mode_name(mode);
    EXPECT_LE(shard_model_state(est, n).peak_total, available) << ac_mode_name(mode);
    EXPECT_GT(shard_model_state(est, n - 1).peak_total, available) << ac_mode_name(mode);
  }
  // Full recomputation holds the fewest activations, so it needs the fewest ranks.
  const int64_t n_full = fsdp_ranks_to_fit(args, shape_8b(AcMode::full), available);
  const int64_t n_op = fsdp_ranks_to_fit(args, shape_8b(AcMode::selective_op), available);
  EXPECT_GT(n_full, 0);
  if (n_op > 0) {
    EXPECT_LE(n_full, n_op);
  }
  // Memory enough for one process: one rank.
  TrainShape small = shape_8b(AcMode::full);
  EXPECT_EQ(fsdp_ranks_to_fit(model_flavor("llama3", "debugmodel"), small, available), 1);
}

}  // namespace
}  // namespace anvil
