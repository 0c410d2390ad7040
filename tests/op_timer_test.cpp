// The per-op time table ([profiling] op_times): how ops are attributed
// (phase, nesting, parallel regions), what the table prints, and that a
// training run writes it with the model's ops. Times are never asserted on;
// calls, FLOPs and attribution are.
#include "anvil/core/op_timer.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "anvil/core/profiler.h"
#include "anvil/estimate/flops.h"
#include "anvil/model/args.h"
#include "anvil/obs/op_table.h"
#include "test_util.h"

namespace fs = std::filesystem;
using anvil::OpTimer;
using anvil::OpTimeRow;
using anvil::ScopedOpTime;

namespace {

const OpTimeRow* find(const std::vector<OpTimeRow>& rows, const std::string& phase, const std::string& parent,
                      const std::string& op) {
  for (const OpTimeRow& r : rows)
    if (r.phase == phase && r.parent == parent && r.op == op) return &r;
  return nullptr;
}

// Busy work the optimiser cannot drop, so nested scopes take measurable time.
double spin(int n) {
  volatile double x = 0;
  for (int i = 0; i < n; ++i) x = x + 1e-9 * i;
  return x;
}

struct TimingOn {
  TimingOn() {
    OpTimer::reset();
    OpTimer::set_enabled(true);
  }
  ~TimingOn() { OpTimer::set_enabled(false); }
};

}  // namespace

TEST(OpTimer, OffRecordsNothing) {
  OpTimer::reset();
  OpTimer::set_enabled(false);
  { const ScopedOpTime op("matmul", 100); }
  EXPECT_TRUE(OpTimer::rows().empty());
}

TEST(OpTimer, RowsAreKeyedByPhaseWithTheLayerDroppedAndSumCallsAndFlops) {
  const TimingOn on;
  for (int layer = 0; layer < 3; ++layer) {
    const anvil::ScopedPhase phase(anvil::SpanCategory::forward, "attention.forward", layer);
    const ScopedOpTime a("linear.forward", 10);
    const ScopedOpTime b("linear.forward", 5);  // nested in a: its own row under a
  }
  { const ScopedOpTime c("adamw"); }
  const std::vector<OpTimeRow> rows = OpTimer::rows();
  ASSERT_EQ(rows.size(), 3u);
  const OpTimeRow* outer = find(rows, "attention.forward", "", "linear.forward");
  const OpTimeRow* inner = find(rows, "attention.forward", "linear.forward", "linear.forward");
  const OpTimeRow* adamw = find(rows, "", "", "adamw");
  ASSERT_TRUE(outer && inner && adamw);
  EXPECT_EQ(outer->calls, 3);
  EXPECT_EQ(outer->flops, 30);
  EXPECT_EQ(inner->calls, 3);
  EXPECT_EQ(inner->flops, 15);
  EXPECT_EQ(adamw->calls, 1);
  EXPECT_EQ(adamw->flops, 0);
}

TEST(OpTimer, AnOuterOpsSelfTimeLeavesOutTheOpsInsideIt) {
  const TimingOn on;
  // The inner op does almost all the work: the outer one's own time must be the smaller.
  for (int i = 0; i < 5; ++i) {
    const ScopedOpTime outer("outer");
    const ScopedOpTime inner("inner");
    spin(2'000'000);
  }
  const std::vector<OpTimeRow> rows = OpTimer::rows();
  const OpTimeRow* outer = find(rows, "", "", "outer");
  const OpTimeRow* inner = find(rows, "", "outer", "inner");
  ASSERT_TRUE(outer && inner);
  EXPECT_GE(outer->self_seconds, 0.0);
  EXPECT_GT(inner->self_seconds, 0.0);
  EXPECT_LT(outer->self_seconds, inner->self_seconds);
  EXPECT_EQ(rows.front().op, "inner") << "the longest first";
}

// A device clock whose stamps are scripted: stamp i reads at times[i] seconds.
class ScriptedClock : public anvil::DeviceClock {
 public:
  explicit ScriptedClock(std::vector<double> times) : times_(std::move(times)) {}
  uint32_t stamp() override { return taken_++; }
  double seconds_between(uint32_t from, uint32_t to) override {
    EXPECT_LT(to, taken_) << "a stamp read before it was taken";
    ++reads;
    return times_.at(to) - times_.at(from);
  }
  void clear() override {
    taken_ = 0;
    ++clears;
  }
  int reads = 0, clears = 0;

 private:
  std::vector<double> times_;
  uint32_t taken_ = 0;
};

TEST(OpTimer, OnADeviceTheStampsTimeTheOpsAndAreReadWhenTimingStops) {
  // outer [0, 10] s holding inner [1, 4] s and inner [5, 9] s, then adamw [10, 12] s
  // (the stamps in the order the scopes open and close).
  ScriptedClock clock({0, 1, 4, 5, 9, 10, 10, 12});
  OpTimer::set_device_clock(&clock);
  OpTimer::reset();
  OpTimer::set_enabled(true);
  {
    const ScopedOpTime outer("outer", 3);
    { const ScopedOpTime inner("inner", 1); }
    { const ScopedOpTime inner("inner", 1); }
  }
  { const ScopedOpTime adamw("adamw"); }
  EXPECT_EQ(clock.reads, 0) << "nothing waits for the device while the step runs";
  OpTimer::set_enabled(false);
  OpTimer::set_device_clock(nullptr);
  EXPECT_EQ(clock.reads, 4);
  EXPECT_EQ(clock.clears, 2);  // reset() and the read: the stamps are reused
  const std::vector<OpTimeRow> rows = OpTimer::rows();
  const OpTimeRow* outer = find(rows, "", "", "outer");
  const OpTimeRow* inner = find(rows, "", "outer", "inner");
  const OpTimeRow* adamw = find(rows, "", "", "adamw");
  ASSERT_TRUE(outer && inner && adamw);
  EXPECT_EQ(outer->calls, 1);
  EXPECT_DOUBLE_EQ(outer->self_seconds, 10.0 - 3.0 - 4.0);
  EXPECT_EQ(inner->calls, 2);
  EXPECT_DOUBLE_EQ(inner->self_seconds, 7.0);
  EXPECT_EQ(inner->flops, 2);
  EXPECT_DOUBLE_EQ(adamw->self_seconds, 2.0);
}

TEST(OpTimer, OpsCalledInsideAParallelRegionBelongToTheOpThatOpenedIt) {
  const TimingOn on;
  {
    const ScopedOpTime outer("attention.forward");
#pragma omp parallel num_threads(2)
    { const ScopedOpTime tile("gemm", 7); }
  }
  const std::vector<OpTimeRow> rows = OpTimer::rows();
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0].op, "attention.forward");
}

TEST(OpTimer, OnlyTheThreadThatTurnedTimingOnIsTimed) {
  const TimingOn on;
  std::thread other([] { const ScopedOpTime op("copy"); });
  other.join();
  { const ScopedOpTime op("adamw"); }
  const std::vector<OpTimeRow> rows = OpTimer::rows();
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0].op, "adamw");
}

TEST(OpTable, TheMarkdownSumsToTheStepAndCountsNestedFlopsOnce) {
  anvil::OpTable t;
  t.steps = 2;
  t.step_seconds = 2.0;  // 1 s per step
  t.rows = {{"loss", "", "cross_entropy.forward_backward", 2, 0.2, 6.4e9},
            {"loss", "cross_entropy.forward_backward", "gemm", 14, 0.6, 8e9},
            {"attention.forward", "", "linear.forward", 8, 0.8, 4e9}};
  const std::string md = anvil::op_table_markdown(t);
  // Per step: 0.1 + 0.3 + 0.4 s in ops, 0.2 s outside them.
  EXPECT_NE(md.find("| loss | cross_entropy.forward_backward > gemm | 7.0 | 300.00 | 30.0 | 4.00 | 0.013 |"),
            std::string::npos) << md;
  // The outer op's rate is over its time with the products inside it: 3.2 GFLOP in 0.4 s.
  EXPECT_NE(md.find("| loss | cross_entropy.forward_backward | 1.0 | 100.00 | 10.0 | 3.20 | 0.008 (with nested) |"),
            std::string::npos) << md;
  EXPECT_NE(md.find("| - | (not in an op) | | 200.00 | 20.0 | | |"), std::string::npos) << md;
  // Step FLOPs: the outer ops only (3.2 + 2 GFLOP per step), not the nested products again.
  EXPECT_NE(md.find("| | **step** | | 1000.00 | 100.0 | 5.20 | 0.005 |"), std::string::npos) << md;
  const nlohmann::json j = anvil::op_table_json(t);
  EXPECT_EQ(j.at("steps"), 2);
  EXPECT_DOUBLE_EQ(j.at("not_in_an_op_seconds").get<double>(), 0.2);
  EXPECT_EQ(j.at("ops").size(), 3u);
}

TEST(OpTable, ATrainingRunWritesTheTableWithTheModelsOps) {
  const fs::path dir = anvil::testing::scratch_root() / "anvil_op_timer_test";
  fs::remove_all(dir);
  fs::create_directories(dir);
  {
    std::ofstream text(dir / "text.txt");
    for (int i = 0; i < 300; ++i) text << "Line " << i % 13 << ": the report praised the handling of the election.\n";
  }
  const auto out = anvil::testing::run_anvil(
      "train --training.dataset text --training.dataset_path " + (dir / "text.txt").string() +
      " --training.seq_len 64 --training.local_batch_size 2 --training.steps 3 --metrics.log_freq 1"
      " --activation_checkpoint.mode none --profiling.op_times --job.dump_folder " + (dir / "run").string());
  ASSERT_EQ(out.exit_code, 0) << out.text;
  EXPECT_NE(out.text.find("time per op, the mean of 2 steps after the first"), std::string::npos) << out.text;
  EXPECT_TRUE(fs::exists(dir / "run" / "op_times.md"));
  std::ifstream in(dir / "run" / "op_times.json");
  const nlohmann::json j = nlohmann::json::parse(in);
  EXPECT_EQ(j.at("steps"), 2);
  std::set<std::string> seen;
  double flops = 0;
  for (const nlohmann::json& r : j.at("ops")) {
    seen.insert(r.at("phase").get<std::string>() + " " + r.at("op").get<std::string>());
    if (r.at("parent") == "") flops += r.at("flops").get<double>();
  }
  for (const char* want : {"attention.forward linear.forward", "attention.forward attention.forward",
                           "attention.backward attention.backward", "feed_forward.backward linear.backward_weight",
                           "loss cross_entropy.forward_backward",
                           "optimizer adamw"})
    EXPECT_TRUE(seen.count(want)) << want;
  // The ops credit the model's FLOPs per step (torchtitan's count) over 2 x 64 tokens, but for
  // the norms' weights, which the count includes (6 per weight per token) and no product does.
  const anvil::ModelArgs args = anvil::model_flavor("llama3", "debugmodel");
  const double norm_weights = static_cast<double>((2 * args.n_layers + 1) * args.dim);
  const double expected = 128 * (anvil::flops_per_token(args, 64) - 6 * norm_weights);
  EXPECT_NEAR(flops, expected, 1e-9 * expected);
}
