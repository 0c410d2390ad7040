#include "anvil/obs/op_table.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "anvil/core/durable_file.h"

namespace anvil {

namespace {

double op_seconds(const OpTable& t) {
  double s = 0;
  for (const OpTimeRow& r : t.rows) s += r.self_seconds;
  return s;
}

// A row's time with the ops called inside it: an outer op's FLOPs (the fused
// loss's) are done by its nested products, so its rate is over both.
double inclusive_seconds(const OpTable& t, const OpTimeRow& r) {
  double s = r.self_seconds;
  for (const OpTimeRow& c : t.rows)
    if (c.parent == r.op && c.phase == r.phase) s += c.self_seconds;
  return s;
}

// The step's FLOPs: outer ops only (nested products are part of theirs).
double step_flops(const OpTable& t) {
  double f = 0;
  for (const OpTimeRow& r : t.rows)
    if (r.parent.empty()) f += r.flops;
  return f;
}

std::string op_label(const OpTimeRow& r) { return r.parent.empty() ? r.op : r.parent + " > " + r.op; }

std::string line(const char* fmt, auto... args) {
  char buf[512];
  std::snprintf(buf, sizeof buf, fmt, args...);
  return buf;
}

}  // namespace

std::string op_table_markdown(const OpTable& t) {
  const double n = static_cast<double>(std::max<int64_t>(1, t.steps));
  const double step = t.step_seconds / n;
  std::string out = "| phase | op | calls | ms | % of step | GFLOP | TFLOP/s |\n|---|---|---:|---:|---:|---:|---:|\n";
  for (const OpTimeRow& r : t.rows) {
    const double s = r.self_seconds / n;
    std::string rate = "", gflop = "";
    if (r.flops > 0) {
      gflop = line("%.2f", r.flops / n * 1e-9);
      const double with_nested = inclusive_seconds(t, r);
      rate = line(with_nested > r.self_seconds ? "%.3f (with nested)" : "%.3f",
                  with_nested > 0 ? r.flops / with_nested * 1e-12 : 0.0);
    }
    out += line("| %s | %s | %.1f | %.2f | %.1f | %s | %s |\n", r.phase.empty() ? "-" : r.phase.c_str(),
                op_label(r).c_str(), static_cast<double>(r.calls) / n, s * 1e3, step > 0 ? 100 * s / step : 0.0,
                gflop.c_str(), rate.c_str());
  }
  const double outside = (t.step_seconds - op_seconds(t)) / n;
  out += line("| - | (not in an op) | | %.2f | %.1f | | |\n", outside * 1e3, step > 0 ? 100 * outside / step : 0.0);
  const double flops = step_flops(t);
  out += line("| | **step** | | %.2f | 100.0 | %.2f | %.3f |\n", step * 1e3, flops / n * 1e-9,
              t.step_seconds > 0 ? flops / t.step_seconds * 1e-12 : 0.0);
  return out;
}

nlohmann::json op_table_json(const OpTable& t) {
  const double n = static_cast<double>(std::max<int64_t>(1, t.steps));
  nlohmann::json rows = nlohmann::json::array();
  for (const OpTimeRow& r : t.rows)
    rows.push_back({{"phase", r.phase},
                    {"parent", r.parent},
                    {"op", r.op},
                    {"calls", static_cast<double>(r.calls) / n},
                    {"seconds", r.self_seconds / n},
                    {"flops", r.flops / n}});
  return {{"steps", t.steps},
          {"step_seconds", t.step_seconds / n},
          {"not_in_an_op_seconds", (t.step_seconds - op_seconds(t)) / n},
          {"ops", rows}};
}

void write_op_table(const OpTable& t, const std::string& folder) {
  const std::filesystem::path dir(folder);
  write_file_durably((dir / "op_times.md").string(), op_table_markdown(t));
  write_file_durably((dir / "op_times.json").string(), op_table_json(t).dump(1) + "\n");
}

}  // namespace anvil
