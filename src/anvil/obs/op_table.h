// The per-op time table ([profiling] op_times): where the timed steps' wall
// time went, op by op, with each op's share of the step and its rate on the
// FLOPs the model's count credits. The rows come from core/op_timer.h; what
// no op accounts for (data loading, bookkeeping between ops) is its own row,
// so the table sums to the step.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "anvil/core/op_timer.h"

namespace anvil {

struct OpTable {
  std::vector<OpTimeRow> rows;  // summed over `steps`, the longest first
  int64_t steps = 0;
  double step_seconds = 0;      // the wall time of those steps, summed
};

// A markdown table, per step: phase, op, calls, ms, % of the step, GFLOP, TFLOP/s.
std::string op_table_markdown(const OpTable& t);
// The same rows as JSON (seconds and FLOPs per step), for scripts.
nlohmann::json op_table_json(const OpTable& t);
// Writes op_times.md and op_times.json into `folder`; throws anvil::Error naming the path.
void write_op_table(const OpTable& t, const std::string& folder);

}  // namespace anvil
