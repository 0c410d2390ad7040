#include "anvil/obs/report.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>

#include "anvil/core/error.h"
#include "anvil/estimate/memory.h"
#include "anvil/obs/dump_reader.h"
#include "anvil/obs/svg_chart.h"

namespace fs = std::filesystem;

namespace anvil {

namespace {

using svg::escape_xml;

// Fixed colours per memory category, the same in every chart and table.
constexpr std::array<const char*, kNumMemCategories> kCategoryColor = {
    "#4e79a7",  // parameters
    "#f28e2b",  // gradients
    "#59a14f",  // optimizer_state
    "#e15759",  // activations
    "#76b7b2",  // communication
    "#b07aa1",  // workspace
};
// Stacking order, bottom first: what stays through a step at the bottom, and
// activations, which rise in the forward and fall in the backward, on top.
constexpr std::array<MemCategory, kNumMemCategories> kStackOrder = {
    MemCategory::parameters,    MemCategory::optimizer_state, MemCategory::gradients,
    MemCategory::communication, MemCategory::workspace,       MemCategory::activations,
};

// "optimizer_state" as a reader writes it.
std::string spaced(std::string s) {
  std::replace(s.begin(), s.end(), '_', ' ');
  return s;
}
std::string category_label(MemCategory c) { return spaced(category_name(c)); }

const char* category_color(const std::string& name) {
  for (int c = 0; c < kNumMemCategories; ++c)
    if (name == category_name(static_cast<MemCategory>(c))) return kCategoryColor[c];
  return "#9d9d9d";
}

// Light colours for the phases of a step, so they read as background to the memory areas.
const char* phase_color(const std::string& category) {
  static const std::map<std::string, const char*> colors = {
      {"data", "#c9c3bd"},       {"forward", "#a0cbe8"},       {"backward", "#ffbe7d"},
      {"recompute", "#f1ce63"},  {"loss", "#d4a6c8"},          {"optimizer", "#8cd17d"},
      {"checkpoint", "#d7b5a6"}, {"communication", "#86bcb6"}, {"step", "#e4e4e4"},
  };
  const auto it = colors.find(category);
  return it == colors.end() ? "#d0d0d0" : it->second;
}

template <class... Args>
std::string format(const char* f, Args... args) {
  char s[256];
  std::snprintf(s, sizeof s, f, args...);
  return s;
}

std::string bytes_text(double bytes) {
  if (!std::isfinite(bytes)) return "–";
  return bytes == 0 ? "0" : human_bytes(static_cast<size_t>(bytes));
}

// The binary unit that keeps an axis' numbers between 1 and 1024.
struct ByteUnit {
  double scale;
  const char* name;
};
ByteUnit byte_unit(double max_bytes) {
  if (max_bytes >= 1024.0 * 1024 * 1024) return {1024.0 * 1024 * 1024, "GiB"};
  if (max_bytes >= 1024.0 * 1024) return {1024.0 * 1024, "MiB"};
  if (max_bytes >= 1024.0) return {1024.0, "KiB"};
  return {1, "bytes"};
}

// Time axis of a trace: microseconds, milliseconds or seconds, whichever keeps the numbers short.
struct TimeUnit {
  double us;
  const char* name;
};
TimeUnit time_unit(double span_us) {
  if (span_us < 2e3) return {1, "µs"};
  if (span_us < 1e7) return {1e3, "ms"};  // below 10 s: tick labels stay under 10000
  return {1e6, "s"};
}

std::string clock_text(double seconds) {
  if (!std::isfinite(seconds)) return "–";
  if (seconds < 60) return format("%.1f s", seconds);
  const auto s = static_cast<long long>(seconds + 0.5);
  return s >= 3600 ? format("%lld:%02lld:%02lld", s / 3600, s / 60 % 60, s % 60)
                   : format("%lld:%02lld", s / 60, s % 60);
}

std::vector<double> column(const std::vector<TrainMetrics>& rows, double TrainMetrics::*field) {
  std::vector<double> v;
  for (const auto& r : rows) v.push_back(r.*field);
  return v;
}

double median(std::vector<double> v) {
  v.erase(std::remove_if(v.begin(), v.end(), [](double x) { return !std::isfinite(x); }), v.end());
  if (v.empty()) return kMissing;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

// TensorBoard's debiased exponential moving average: a noisy per-batch loss
// shows its trend; missing values stay missing.
std::vector<double> smoothed(const std::vector<double>& y, double weight) {
  std::vector<double> out;
  double average = 0;
  int n = 0;
  for (const double v : y) {
    if (!std::isfinite(v)) {
      out.push_back(kMissing);
      continue;
    }
    average = average * weight + (1 - weight) * v;
    ++n;
    out.push_back(average / (1 - std::pow(weight, n)));
  }
  return out;
}

std::string figure(const std::string& title, const std::string& note, const std::string& chart,
                   const std::string& extra_class = "") {
  return "<figure class=\"card" + extra_class + "\"><figcaption><b>" + escape_xml(title) + "</b><span>" +
         escape_xml(note) + "</span></figcaption>" + chart + "</figure>\n";
}

std::string stat(const std::string& label, const std::string& value, const std::string& note) {
  return "<div class=\"stat\"><div class=\"label\">" + escape_xml(label) + "</div><div class=\"value\">" +
         escape_xml(value) + "</div><div class=\"note\">" + escape_xml(note) + "</div></div>";
}

std::string swatch(const std::string& color) { return "<i class=\"sw\" style=\"background:" + color + "\"></i>"; }

std::string relative_to(const std::string& path, const fs::path& folder) {
  std::error_code ec;
  const fs::path r = fs::relative(path, folder, ec);
  return ec || r.empty() || r.native().rfind("..", 0) == 0 ? path : r.string();
}

// ---------------------------------------------------------------- header

std::string header_html(const RunMetrics& m, const fs::path& folder) {
  const TrainMetrics& last = m.train.back();
  std::string loss_note = format("step %lld", static_cast<long long>(last.step));
  if (!m.validation.empty())
    loss_note += format(" · validation %.4f at step %lld", m.validation.back().loss,
                        static_cast<long long>(m.validation.back().step));
  const TrainMetrics* peak = nullptr;
  for (const auto& r : m.train)
    if (std::isfinite(r.max_active_bytes) && (!peak || r.max_active_bytes > peak->max_active_bytes)) peak = &r;
  const double tps = median(column(m.train, &TrainMetrics::tokens_per_s));
  const double mfu = median(column(m.train, &TrainMetrics::mfu_pct));
  const double tflops = median(column(m.train, &TrainMetrics::tflops));
  const double data = median(column(m.train, &TrainMetrics::data_loading_pct));

  std::string h =
      "<header><h1>Training report</h1><div class=\"run\">" + escape_xml(folder.string()) + "</div></header>\n";
  h += "<section class=\"stats\">";
  h += stat("steps",
            format("%lld – %lld", static_cast<long long>(m.train.front().step), static_cast<long long>(last.step)),
            format("%zu logged", m.train.size()));
  h += stat("final loss", std::isfinite(last.loss) ? format("%.4f", last.loss) : "–", loss_note);
  h += stat("tokens/s", std::isfinite(tps) ? format("%.0f", tps) : "–", "median over logged steps");
  h += stat("MFU", std::isfinite(mfu) ? format("%.2f %%", mfu) : "–",
            std::isfinite(tflops) ? format("median · %.3g TFLOP/s", tflops) : "median");
  h += stat("peak memory", peak ? bytes_text(peak->max_active_bytes) : "–",
            peak ? format("max_active_bytes, step %lld", static_cast<long long>(peak->step)) : "");
  h += stat("wall time", clock_text(last.elapsed_s),
            std::isfinite(data) ? format("data loading %.1f %% (median)", data) : "");
  h += "</section>\n";
  if (m.replaced_lines > 0)
    h += format(
        "<p class=\"notice\">%lld line(s) of metrics.jsonl repeat a step already logged (a resumed run "
        "appends again); the later line of each step is used.</p>\n",
        static_cast<long long>(m.replaced_lines));
  return h;
}

// ---------------------------------------------------------------- charts over steps

svg::Chart step_chart(const std::string& label, const std::string& y_unit, bool from_zero) {
  svg::Chart c;
  c.label = label;
  c.x = {"step", false, true};
  c.y = {y_unit, from_zero, false};
  return c;
}

svg::Line line(const std::string& name, const char* color, const std::vector<TrainMetrics>& rows,
               double TrainMetrics::*field) {
  std::vector<double> x;
  for (const auto& r : rows) x.push_back(static_cast<double>(r.step));
  return {name, color, x, column(rows, field)};
}

std::string loss_chart(const RunMetrics& m) {
  svg::Chart c = step_chart("loss per step", "loss", false);
  svg::Line train = line("train", "#4e79a7", m.train, &TrainMetrics::loss);
  // Enough points to be noisy: draw the raw curve faint under its smoothed trend.
  if (train.x.size() >= 30) {
    svg::Line trend = train;
    trend.name = "train (smoothed)";
    trend.y = smoothed(train.y, 0.6);
    train.opacity = 0.35;
    c.lines.push_back(train);
    c.lines.push_back(trend);
  } else {
    train.markers = train.x.size() <= 2;
    c.lines.push_back(train);
  }
  if (!m.validation.empty()) {
    svg::Line v{"validation", "#e15759", {}, {}, true};
    for (const auto& r : m.validation) v.x.push_back(static_cast<double>(r.step)), v.y.push_back(r.loss);
    c.lines.push_back(v);
  }
  std::string note = "cross-entropy per token";
  if (!m.validation.empty())
    note += format(" · validation on %lld tokens", static_cast<long long>(m.validation.back().tokens));
  return figure("Loss", note, svg::render(c));
}

std::string single_metric_chart(const RunMetrics& m, const std::string& title, const std::string& note,
                                const std::string& unit, const char* color, double TrainMetrics::*field,
                                bool from_zero) {
  svg::Chart c = step_chart(title, unit, from_zero);
  svg::Line l = line(title, color, m.train, field);
  l.markers = l.x.size() <= 2;  // a line needs two points
  l.name.clear();               // one series: the caption names it
  c.lines.push_back(l);
  c.empty_message = "no " + unit + " in metrics.jsonl";
  return figure(title, note, svg::render(c));
}

std::string memory_over_steps_chart(const RunMetrics& m) {
  double max_bytes = 0;
  for (const auto& r : m.train) {
    double sum = 0;
    for (const double b : r.max_active_bytes_by_category) sum += std::isfinite(b) ? b : 0;
    max_bytes = std::max({max_bytes, sum, std::isfinite(r.max_active_bytes) ? r.max_active_bytes : 0});
  }
  const ByteUnit unit = byte_unit(max_bytes);
  svg::Chart c = step_chart("peak memory by category per step", unit.name, true);
  svg::Stack s;
  for (const auto& r : m.train) s.x.push_back(static_cast<double>(r.step));
  for (const MemCategory cat : kStackOrder) {
    const int ci = static_cast<int>(cat);
    std::vector<double> y;
    bool any = false;
    for (const auto& r : m.train) {
      const double b = r.max_active_bytes_by_category[ci];
      y.push_back(std::isfinite(b) ? b / unit.scale : 0);
      any = any || (std::isfinite(b) && b > 0);
    }
    if (!any) continue;  // a category no step used (communication in a single process) only clutters the legend
    s.names.push_back(category_label(cat));
    s.colors.push_back(kCategoryColor[ci]);
    s.y.push_back(std::move(y));
  }
  if (!s.y.empty()) c.stack = std::move(s);
  svg::Line total = line("peak of the total", "#333333", m.train, &TrainMetrics::max_active_bytes);
  for (double& y : total.y) y /= unit.scale;
  total.dashed = true;
  c.lines.push_back(total);
  c.empty_message = "no max_active_bytes in metrics.jsonl";
  // Categories peak at different moments, so their stacked peaks can exceed the peak of the sum.
  return figure("Peak memory by category", "per-category peaks between log lines, stacked; dashed: peak of the total",
                svg::render(c));
}

std::string step_charts_html(const RunMetrics& m) {
  const double tps = median(column(m.train, &TrainMetrics::tokens_per_s));
  std::string h = "<section class=\"grid\">\n";
  h += loss_chart(m);
  h += single_metric_chart(m, "Gradient norm", "global L2 norm of the gradients", "grad norm", "#9c755f",
                           &TrainMetrics::grad_norm, true);
  h += single_metric_chart(m, "Throughput", std::isfinite(tps) ? format("tokens per second · median %.0f", tps) : "",
                           "tokens/s", "#59a14f", &TrainMetrics::tokens_per_s, true);
  h += single_metric_chart(m, "MFU", "model FLOPs utilisation against the CPU's peak", "MFU %", "#f28e2b",
                           &TrainMetrics::mfu_pct, true);
  h += single_metric_chart(m, "Learning rate", "after warm-up and decay", "learning rate", "#b07aa1", &TrainMetrics::lr,
                           true);
  h += memory_over_steps_chart(m);
  h += "</section>\n";
  return h;
}

// ---------------------------------------------------------------- one step's memory timeline

// A run of consecutive spans of one category at the phase level: the
// per-layer forward spans of a micro-batch make one "forward" phase.
struct Phase {
  std::string category;
  double start_us, end_us;
  std::vector<const TraceSpan*> spans;
};

std::vector<Phase> merge_phases(const std::vector<const TraceSpan*>& spans) {
  std::vector<Phase> out;
  for (const TraceSpan* s : spans) {
    if (!out.empty() && out.back().category == s->category) {
      out.back().end_us = std::max(out.back().end_us, s->end_us());
      out.back().spans.push_back(s);
    } else {
      out.push_back({s->category, s->start_us, s->end_us(), {s}});
    }
  }
  return out;
}

std::string timeline_html(const TraceFileStep& t, const std::vector<TraceFile>& traces, const fs::path& folder) {
  // The phases are the children of the step span on its thread (or the outermost spans without one).
  const auto step_span = std::find_if(t.spans.begin(), t.spans.end(), [&](const TraceSpan& s) {
    return s.category == "step" && s.depth == 0 && s.thread == t.main_thread;
  });
  const int phase_depth = step_span != t.spans.end() ? 1 : 0;
  double start = INFINITY, end = -INFINITY;
  if (step_span != t.spans.end()) {
    start = step_span->start_us, end = step_span->end_us();
  } else {
    for (const auto& s : t.spans) start = std::min(start, s.start_us), end = std::max(end, s.end_us());
  }
  if (!t.memory.empty())
    start = std::min(start, t.memory.front().time_us), end = std::max(end, t.memory.back().time_us);
  if (!(end > start)) end = start + 1;
  const TimeUnit unit = time_unit(end - start);
  auto x_of = [&](double us) { return (us - start) / unit.us; };
  auto duration = [&](double us) { return format("%.3g %s", us / unit.us, unit.name); };

  double max_total = 0;
  for (const auto& s : t.memory) max_total = std::max(max_total, s.total());
  const ByteUnit bytes = byte_unit(max_total);

  svg::Chart c;
  c.label = format("live memory by category during step %lld", static_cast<long long>(t.step));
  c.width = 1180;
  c.plot_height = 230;
  c.x = {unit.name, false, false};
  c.y = {bytes.name, true, false};
  c.empty_message = "this trace has no memory counters";

  // Lanes: phases, then up to two levels of the spans inside them, then other threads.
  std::vector<const TraceSpan*> phase_spans;
  std::map<int, std::vector<const TraceSpan*>> inner;  // depth -> spans on the main thread
  std::map<int64_t, std::vector<const TraceSpan*>> other_threads;
  for (const auto& s : t.spans) {
    if (s.thread != t.main_thread) {
      if (s.depth == 0) other_threads[s.thread].push_back(&s);
    } else if (s.depth == phase_depth) {
      phase_spans.push_back(&s);
    } else if (s.depth > phase_depth && s.depth <= phase_depth + 2) {
      inner[s.depth].push_back(&s);
    }
  }
  const std::vector<Phase> phases = merge_phases(phase_spans);
  auto span_band = [&](const TraceSpan& s, int lane) {
    // "layers.3.forward" in a forward band reads as "layers.3" where the whole name does not fit.
    const size_t dot = s.name.rfind('.');
    c.bands.push_back({x_of(s.start_us), x_of(s.end_us()), s.name, phase_color(s.category),
                       s.name + " (" + s.category + ") " + duration(s.duration_us), lane,
                       dot == std::string::npos ? "" : s.name.substr(0, dot)});
  };
  if (!phases.empty()) {
    c.lanes.push_back("phases");
    for (const Phase& p : phases) {
      std::string tip = p.category + " " + duration(p.end_us - p.start_us);
      if (p.spans.size() > 1)
        tip += format(", %zu spans: ", p.spans.size()) + p.spans.front()->name + " … " + p.spans.back()->name;
      else
        tip += ": " + p.spans.front()->name;
      // Behind the memory areas, so a rise lines up with its phase; and labelled in the lane.
      c.bands.push_back({x_of(p.start_us), x_of(p.end_us), p.category, phase_color(p.category), tip, -1, ""});
      c.bands.push_back({x_of(p.start_us), x_of(p.end_us), p.category, phase_color(p.category), tip, 0, ""});
    }
  }
  for (const auto& [depth, spans] : inner) {
    const int lane = static_cast<int>(c.lanes.size());
    c.lanes.push_back(depth == phase_depth + 1 ? "spans" : "sub-spans");
    for (const TraceSpan* s : spans) span_band(*s, lane);
  }
  for (const auto& [thread, spans] : other_threads) {
    if (c.lanes.size() >= 6) break;
    const int lane = static_cast<int>(c.lanes.size());
    const auto name = t.thread_names.find(thread);
    c.lanes.push_back(name != t.thread_names.end() ? name->second
                                                   : format("thread %lld", static_cast<long long>(thread)));
    for (const TraceSpan* s : spans) span_band(*s, lane);
  }

  // Live bytes per category, held between counter events and to the end of the step.
  std::string table;
  if (!t.memory.empty()) {
    svg::Stack s;
    s.steps = true;
    for (const auto& m : t.memory) s.x.push_back(x_of(m.time_us));
    if (x_of(end) > s.x.back()) s.x.push_back(x_of(end));
    const MemorySample& first = t.memory.front();
    const MemorySample& last = t.memory.back();
    const MemorySample& peak = *std::max_element(t.memory.begin(), t.memory.end(),
                                                 [](const auto& a, const auto& b) { return a.total() < b.total(); });
    table =
        "<table class=\"numbers\"><thead><tr><th>category</th><th>step start</th><th>at the peak</th><th>step "
        "end</th><th>change</th></tr></thead><tbody>";
    auto signed_bytes = [](double change) {
      if (change == 0) return std::string("–");
      std::string out = change > 0 ? "+" : "−";
      return out += bytes_text(std::abs(change));
    };
    for (const MemCategory cat : kStackOrder) {
      const int ci = static_cast<int>(cat);
      std::vector<double> y;
      bool any = false;
      for (const auto& m : t.memory) y.push_back(m.live[ci] / bytes.scale), any = any || m.live[ci] > 0;
      if (!any) continue;
      if (y.size() < s.x.size()) y.push_back(y.back());
      s.names.push_back(category_label(cat));
      s.colors.push_back(kCategoryColor[ci]);
      s.y.push_back(std::move(y));
      const double change = last.live[ci] - first.live[ci];
      table += "<tr><td>" + swatch(kCategoryColor[ci]) + escape_xml(category_label(cat)) + "</td><td>" +
               bytes_text(first.live[ci]) + "</td><td>" + bytes_text(peak.live[ci]) + "</td><td>" +
               bytes_text(last.live[ci]) + "</td><td>" + signed_bytes(change) + "</td></tr>";
    }
    table += "<tr class=\"total\"><td>total</td><td>" + bytes_text(first.total()) + "</td><td>" +
             bytes_text(peak.total()) + "</td><td>" + bytes_text(last.total()) + "</td><td></td></tr></tbody></table>";
    c.stack = std::move(s);
    std::string where;
    for (const Phase& p : phases)
      if (p.start_us <= peak.time_us && peak.time_us <= p.end_us) where = " in " + p.category;
    c.notes.push_back({x_of(peak.time_us), peak.total() / bytes.scale, "peak " + bytes_text(peak.total()) + where});
  }

  std::string h = "<section class=\"step\">\n";
  if (!table.empty())
    table = "<div class=\"moments\"><b>Live memory at the step's start, its peak and its end</b>" + table + "</div>";
  h += figure(format("Memory during step %lld", static_cast<long long>(t.step)),
              "live bytes per category after every allocation and free, under the step's phases · " +
                  relative_to(t.path, folder),
              svg::render(c) + table, " wide");
  std::string others;
  for (const auto& f : traces)
    if (f.path != t.path) (others.empty() ? others : others += ", ") += std::to_string(f.step);
  if (!others.empty())
    h += "<p class=\"notice\">Also traced: step(s) " + escape_xml(others) + "; <code>anvil report " +
         escape_xml(folder.string()) + " --trace-step N</code> charts another.</p>\n";
  h += "</section>\n";
  return h;
}

std::string no_trace_html(const fs::path& folder) {
  return "<section class=\"step\"><div class=\"card missing\"><b>No step trace</b><p>No trace file "
         "(<code>step-N.trace.json</code>) under <code>" +
         escape_xml(folder.string()) +
         "</code>, so there is no memory timeline of a step. The trainer writes one for each step it "
         "profiles.</p></div></section>\n";
}

// ---------------------------------------------------------------- memory snapshot

// An out-of-memory snapshot says why a run died, so it comes first; otherwise
// the snapshot with the highest peak, where memory was tightest.
const SnapshotFile& pick_snapshot(const std::vector<SnapshotFile>& snapshots) {
  const SnapshotFile* best = &snapshots.front();
  for (const auto& s : snapshots) {
    const bool oom = s.reason == "out_of_memory", best_oom = best->reason == "out_of_memory";
    if (oom != best_oom ? oom : s.peak_bytes >= best->peak_bytes) best = &s;
  }
  return *best;
}

std::string snapshot_html(const std::vector<SnapshotFile>& snapshots, const fs::path& folder) {
  if (snapshots.empty()) return "";
  const SnapshotFile& s = pick_snapshot(snapshots);
  constexpr size_t kRows = 20;
  std::string h = "<section class=\"card snapshot\"><div class=\"title\"><b>Largest tensors at " +
                  escape_xml(s.reason == "out_of_memory" ? "the out-of-memory error" : "the peak") +
                  format(" of step %lld", static_cast<long long>(s.step)) + "</b><span>" +
                  escape_xml(bytes_text(s.peak_bytes)) + " live · " + escape_xml(relative_to(s.path, folder));
  if (snapshots.size() > 1) h += format(" · %zu snapshots in the folder", snapshots.size());
  h += "</span></div><div class=\"split\">";
  double by_sum = 0;
  for (const double b : s.by_category) by_sum += b;
  if (by_sum > 0) {
    h += "<div class=\"bar\">";
    for (const MemCategory cat : kStackOrder) {
      const double b = s.by_category[static_cast<int>(cat)];
      if (b > 0)
        h += format("<i style=\"width:%.2f%%;background:%s\" title=\"", 100 * b / by_sum,
                    kCategoryColor[static_cast<int>(cat)]) +
             escape_xml(category_label(cat) + " " + bytes_text(b)) + "\"></i>";
    }
    h += "</div><div class=\"keys\">";
    for (const MemCategory cat : kStackOrder) {
      const double b = s.by_category[static_cast<int>(cat)];
      if (b > 0)
        h += "<span>" + swatch(kCategoryColor[static_cast<int>(cat)]) + escape_xml(category_label(cat)) + " " +
             escape_xml(bytes_text(b)) + "</span>";
    }
    h += "</div>";
  }
  h += "</div><table class=\"tensors\"><thead><tr><th>#</th><th>tensor</th><th>category</th><th>allocated in</th>"
       "<th>size</th><th>share of the peak</th></tr></thead><tbody>";
  for (size_t i = 0; i < std::min(kRows, s.largest.size()); ++i) {
    const SnapshotTensor& t = s.largest[i];
    const double share = s.peak_bytes > 0 ? 100 * t.bytes / s.peak_bytes : 0;
    h += format("<tr><td>%zu</td><td><code>", i + 1) + escape_xml(t.name) + "</code></td><td>" +
         swatch(category_color(t.category)) + escape_xml(spaced(t.category)) + "</td><td><code>" + escape_xml(t.phase) +
         "</code></td><td>" + escape_xml(bytes_text(t.bytes)) +
         format("</td><td><span class=\"share\"><i style=\"width:%.1f%%\"></i></span>%.1f %%</td></tr>",
                std::min(100.0, share), share);
  }
  h += "</tbody></table>";
  if (s.largest.size() > kRows)
    h += format("<p class=\"notice\">%zu smaller tensors not shown.</p>", s.largest.size() - kRows);
  h += "</section>\n";
  return h;
}

// ---------------------------------------------------------------- page

constexpr const char* kStyle = R"css(
*{box-sizing:border-box}
body{margin:0;background:#f4f4f1;color:#222;font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif}
main{max-width:1240px;margin:0 auto;padding:20px 24px 32px}
header{display:flex;align-items:baseline;gap:16px;flex-wrap:wrap;margin-bottom:12px}
h1{font-size:22px;margin:0;font-weight:650}
.run{font:13px ui-monospace,"DejaVu Sans Mono",monospace;color:#666;word-break:break-all}
.stats{display:grid;grid-template-columns:repeat(6,minmax(0,1fr));gap:10px;margin-bottom:12px}
.stat,.card{background:#fff;border:1px solid #e2e2dd;border-radius:8px}
.stat{padding:9px 12px}
.stat .label{font-size:12px;color:#777;text-transform:uppercase;letter-spacing:.04em}
.stat .value{font-size:21px;font-weight:650;font-variant-numeric:tabular-nums}
.stat .note{font-size:12px;color:#888}
.grid{display:grid;grid-template-columns:repeat(2,minmax(0,1fr));gap:12px;margin-bottom:12px}
figure{margin:0}
.card{padding:10px 12px 6px}
figcaption,.snapshot .title{display:flex;gap:10px;align-items:baseline;flex-wrap:wrap;margin-bottom:2px}
figcaption span,.snapshot .title span{color:#888;font-size:12px}
.step{display:grid;grid-template-columns:minmax(0,1fr);gap:12px;margin-bottom:12px}
.moments{margin:8px 0 6px}
.moments b{font-size:13px}
.moments table{width:auto;min-width:600px}
.missing p{margin:6px 0 4px;color:#555}
.notice{color:#666;font-size:12.5px;margin:4px 2px 12px}
code{font:12px ui-monospace,"DejaVu Sans Mono",monospace}
table{border-collapse:collapse;width:100%;margin-top:6px;font-variant-numeric:tabular-nums}
th{font-weight:600;color:#666;font-size:12px;text-align:left;border-bottom:1px solid #ddd;padding:4px 8px}
td{padding:3px 8px;border-bottom:1px solid #f0f0ec}
table.numbers td:not(:first-child),table.numbers th:not(:first-child){text-align:right}
tr.total td{font-weight:600;border-bottom:0}
.sw{display:inline-block;width:10px;height:10px;border-radius:2px;margin-right:6px;vertical-align:-1px}
.snapshot{margin-bottom:12px;padding-bottom:10px}
.split{margin:6px 0}
.bar{display:flex;height:12px;border-radius:3px;overflow:hidden}
.bar i{display:block;height:100%}
.keys{display:flex;flex-wrap:wrap;gap:4px 16px;font-size:12px;color:#555;margin-top:4px}
.share{display:inline-block;width:90px;height:8px;background:#eee;border-radius:2px;margin-right:8px;vertical-align:0}
.share i{display:block;height:100%;background:#8aa6c8;border-radius:2px}
.tensors td:nth-child(5),.tensors th:nth-child(5){text-align:right}
footer{color:#888;font-size:12px;margin-top:8px}
#script-errors{color:#b00020;white-space:pre-wrap;font:12px monospace}
#script-errors:empty{display:none}
#tip{position:absolute;pointer-events:none;background:rgba(255,255,255,.96);border:1px solid #ccc;border-radius:6px;
  padding:6px 9px;font-size:12px;box-shadow:0 2px 8px rgba(0,0,0,.12);white-space:nowrap;z-index:9}
#tip .x{color:#777;margin-bottom:2px}
svg.chart{display:block;width:100%;height:auto;overflow:visible}
svg.chart text{font-size:11px;fill:#555}
svg.chart .unit{fill:#333;font-weight:600}
svg.chart .grid{stroke:#ebebe7}
svg.chart .axis{stroke:#aaa}
svg.chart .line{fill:none;stroke-width:1.8;stroke-linejoin:round;stroke-linecap:round}
svg.chart .area{fill-opacity:.85;stroke-width:.5;stroke-linejoin:round}
svg.chart .shade{opacity:.28}
svg.chart .band rect{stroke:#fff;stroke-width:.6}
svg.chart .band text,svg.chart .lane{font-size:10px}
svg.chart .band text{fill:#222}
svg.chart .lane{fill:#777}
svg.chart .note{fill:#222;font-weight:600}
svg.chart line.key{stroke-width:2}
svg.chart .empty{fill:#999;font-style:italic}
svg.chart .hover{stroke:#555;stroke-dasharray:3 3}
@media (max-width:900px){.grid{grid-template-columns:1fr}.stats{grid-template-columns:repeat(3,minmax(0,1fr))}}
)css";

// Hover read-out of the charts' data-tip; the page is complete without it.
constexpr const char* kScript = R"js(
window.onerror = function (message, source, line) {
  var box = document.getElementById('script-errors');
  if (box) box.textContent += message + ' (line ' + line + ')\n';
};
(function () {
  var tip = document.getElementById('tip');
  function esc(s) { return String(s).replace(/[&<>"]/g, function (c) { return '&#' + c.charCodeAt(0) + ';'; }); }
  function fmt(v) { return Math.abs(v) >= 1e4 ? Math.round(v).toLocaleString('en-US') : String(+v.toPrecision(4)); }
  // The point nearest to x; for held values (memory between events) the last one at or before x.
  function nearest(xs, x, held) {
    var lo = 0, hi = xs.length - 1;
    if (hi < 0) return -1;
    while (lo < hi) { var mid = (lo + hi + 1) >> 1; if (xs[mid] <= x) lo = mid; else hi = mid - 1; }
    if (!held && lo + 1 < xs.length && Math.abs(xs[lo + 1] - x) < Math.abs(xs[lo] - x)) lo++;
    return lo;
  }
  function hide(rule) { tip.hidden = true; if (rule) rule.setAttribute('visibility', 'hidden'); }
  document.querySelectorAll('svg.chart').forEach(function (svg) {
    var d = JSON.parse(svg.getAttribute('data-tip'));
    var rule = svg.querySelector('line.hover');
    svg.addEventListener('mousemove', function (ev) {
      var box = svg.getBoundingClientRect(), width = svg.viewBox.baseVal.width;
      var vx = (ev.clientX - box.left) * width / box.width;
      if (vx < d.l || vx > d.r || !d.s.length) return hide(rule);
      var x = d.x0 + (vx - d.l) / (d.r - d.l) * (d.x1 - d.x0), at = null, total = 0, rows = [];
      d.s.forEach(function (s) {
        var i = nearest(s.x, x, d.stack);
        if (i < 0 || s.y[i] === null) return;
        if (at === null) at = s.x[i];
        total += s.y[i];
        rows.push('<span class="sw" style="background:' + esc(s.c) + '"></span>' + esc(s.n) + ' <b>' + fmt(s.y[i]) +
                  ' ' + esc(d.yu) + '</b>' + (s.x[i] !== at ? ' <span class="x">(' + esc(d.xu) + ' ' + fmt(s.x[i]) + ')</span>' : ''));
      });
      if (at === null) return hide(rule);
      if (d.stack && rows.length > 1) rows.push('total <b>' + fmt(total) + ' ' + esc(d.yu) + '</b>');
      tip.innerHTML = '<div class="x">' + esc(d.xu) + ' ' + fmt(at) + '</div>' + rows.join('<br>');
      tip.hidden = false;
      var left = ev.pageX + 14;
      if (left + tip.offsetWidth > window.scrollX + document.documentElement.clientWidth) left = ev.pageX - 14 - tip.offsetWidth;
      tip.style.left = left + 'px';
      tip.style.top = (ev.pageY + 14) + 'px';
      var px = d.l + (at - d.x0) / (d.x1 - d.x0) * (d.r - d.l);
      rule.setAttribute('x1', px); rule.setAttribute('x2', px); rule.setAttribute('visibility', 'visible');
    });
    svg.addEventListener('mouseleave', function () { hide(rule); });
  });
  document.body.dataset.reportStatus = 'ok';
})();
)js";

}  // namespace

std::string render_report(const ReportOptions& options) {
  const fs::path folder = fs::absolute(options.dump_folder).lexically_normal();
  const RunMetrics metrics = read_metrics(options.dump_folder);
  const std::vector<TraceFile> traces = find_traces(options.dump_folder);
  std::optional<TraceFile> chosen;
  if (options.trace_step) {
    for (const auto& f : traces)
      if (f.step == *options.trace_step && !chosen) chosen = f;
    std::string traced;
    for (const auto& f : traces) (traced.empty() ? traced : traced += ", ") += std::to_string(f.step);
    ANVIL_CHECK(chosen.has_value(), "no trace of step ", *options.trace_step, " under ", options.dump_folder.string(),
                traces.empty() ? std::string(" (no *.trace.json files at all)") : "; traced steps: " + traced);
  } else if (!traces.empty()) {
    // Step 1 shows what only the first step does: the optimizer state created.
    chosen = traces.front();
    for (const auto& f : traces)
      if (f.step == 1) {
        chosen = f;
        break;
      }
  }
  const std::vector<SnapshotFile> snapshots = read_snapshots(options.dump_folder);

  std::string page =
      "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
      "<meta name=\"viewport\" content=\"width=device-width,initial-scale=1\"><title>Anvil report · " +
      escape_xml(folder.filename().string()) + "</title><style>" + kStyle + "</style></head>\n<body>\n<main>\n";
  page += header_html(metrics, folder);
  page += "<div id=\"script-errors\" role=\"alert\"></div>\n";
  page += step_charts_html(metrics);
  page += chosen ? timeline_html(read_trace(*chosen), traces, folder) : no_trace_html(folder);
  page += snapshot_html(snapshots, folder);
  page += "<footer>Made by <code>anvil report</code> from " + escape_xml(relative_to(metrics.path, folder)) +
          (chosen ? ", " + escape_xml(relative_to(chosen->path, folder)) : std::string()) +
          (snapshots.empty() ? std::string() : ", " + escape_xml(relative_to(pick_snapshot(snapshots).path, folder))) +
          ". Hover a chart to read its values.</footer>\n</main>\n<div id=\"tip\" hidden></div>\n<script>" + kScript +
          "</script>\n</body></html>\n";
  return page;
}

fs::path write_report(const ReportOptions& options) {
  const std::string page = render_report(options);
  const fs::path out = options.output.empty() ? options.dump_folder / "report.html" : options.output;
  // Written aside and renamed, so a browser showing the old page never reads half a new one.
  const fs::path tmp = fs::path(out.string() + ".tmp");
  {
    std::ofstream f(tmp, std::ios::binary);
    ANVIL_CHECK(f.good(), out.string(), ": cannot write the report (does its folder exist?)");
    f << page;
    ANVIL_CHECK(f.good(), tmp.string(), ": write failed; is the disk full?");
  }
  std::error_code ec;
  fs::rename(tmp, out, ec);
  ANVIL_CHECK(!ec, "cannot rename ", tmp.string(), " to ", out.string(), " (", ec.message(), ")");
  return out;
}

}  // namespace anvil
