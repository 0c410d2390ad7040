// anvil report: the dump-folder readers, the chart helpers, and the page
// itself rendered by a real browser (headless Chromium) — the page must run
// its script without errors and draw every chart.
#include "anvil/obs/report.h"

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>

#include "anvil/core/error.h"
#include "anvil/obs/dump_reader.h"
#include "anvil/obs/svg_chart.h"
#include "test_util.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr double kMiB = 1024.0 * 1024;

fs::path fresh_folder(const std::string& name) {
  const fs::path p = anvil::testing::scratch_root() / "report_test" / name;
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

std::string read_text(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

void write_text(const fs::path& p, const std::string& text) {
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary) << text;
}

// The message of the anvil::Error that `f` throws, or "" if it throws none.
template <class F>
std::string error_of(F f) {
  try {
    f();
  } catch (const anvil::Error& e) {
    return e.what();
  }
  return "";
}

// ------------------------------------------------------------ a synthetic run

// metrics.jsonl as a run of 200 steps logs it every 5 steps, with a crash after
// step 120 and a resume from the checkpoint of step 100 (steps 105..120 are
// logged twice; the first run's copies carry a loss 0.5 higher, so a reader
// that keeps the wrong line is caught), validation every 50 steps, and lines
// and keys of kinds the reader does not know.
std::string metrics_jsonl() {
  std::string out = "{\"run\":\"synthetic\",\"world_size\":1}\n";
  auto train_line = [](int step, double loss_offset) {
    const double noise = 0.06 * std::sin(step * 1.7) + 0.03 * std::sin(step * 5.3);
    const double lr = step <= 20 ? 3e-3 * step / 20 : 3e-4 + 2.7e-3 * 0.5 * (1 + std::cos(M_PI * (step - 20) / 180.0));
    const double tps = step == 1 ? 2150 : 5500 + 180 * std::sin(step * 0.9);
    const double act = 106.9 * kMiB, ws = 16 * kMiB;
    json j = {{"step", step},
              {"loss", 2.9 + 5.2 * std::exp(-step / 35.0) + noise + loss_offset},
              {"grad_norm", 0.35 + 2.6 * std::exp(-step / 25.0) + 0.05 * std::sin(step * 2.3)},
              {"lr", lr},
              {"tokens_per_s", tps},
              {"tflops", tps * 3.9e7 / 1e12},
              {"mfu_pct", tps * 3.9e7 / 5.53e12 * 100},
              {"max_active_bytes", 35.3 * kMiB + 47 * kMiB + (step == 1 ? 0 : 23.5 * kMiB) + act * 0.92 + ws * 0.5},
              {"max_active_bytes_by_category",
               {{"parameters", 35.3 * kMiB},
                {"gradients", 23.5 * kMiB},
                {"optimizer_state", 47 * kMiB},
                {"activations", act},
                {"communication", 0},
                {"workspace", ws}}},
              {"data_loading_pct", step == 1 ? 6.5 : 0.4},
              {"elapsed_s", step * 0.37},
              {"a_future_metric", 1}};
    return j.dump() + "\n";
  };
  std::vector<int> steps = {1};
  for (int s = 5; s <= 120; s += 5) steps.push_back(s);
  for (const int s : steps) {
    out += train_line(s, s > 100 ? 0.5 : 0.0);
    if (s % 50 == 0)
      out +=
          json{{"step", s}, {"validation_loss", 3.1 + 5.2 * std::exp(-s / 35.0)}, {"validation_tokens", 20480}}.dump() +
          "\n";
  }
  out += "{\"step\":120,\"event\":\"interrupted\"}\n";
  for (int s = 105; s <= 200; s += 5) {
    out += train_line(s, 0.0);
    if (s % 50 == 0)
      out +=
          json{{"step", s}, {"validation_loss", 3.1 + 5.2 * std::exp(-s / 35.0)}, {"validation_tokens", 20480}}.dump() +
          "\n";
  }
  return out;
}

// A Chrome trace of one training step with the shape of the first: the batch
// read, the forward's activations rising layer by layer, the loss head's
// workspace, the backward (with recompute) freeing activations while gradients
// are created, then the optimizer creating its state (step 1 only) and the
// gradients freed. Live bytes per category after every allocation and free.
class TraceWriter {
 public:
  explicit TraceWriter(int step) : step_(step) {
    for (const auto& [tid, name] : {std::pair{1, "main"}, std::pair{2, "loader"}})
      events_.push_back({{"ph", "M"}, {"name", "thread_name"}, {"pid", 0}, {"tid", tid}, {"args", {{"name", name}}}});
  }
  void span(const std::string& name, const std::string& cat, double start_ms, double dur_ms, int tid = 1) {
    events_.push_back({{"ph", "X"},
                       {"name", name},
                       {"cat", cat},
                       {"ts", start_ms * 1000},
                       {"dur", dur_ms * 1000},
                       {"pid", 0},
                       {"tid", tid}});
  }
  void memory(double at_ms, anvil::MemCategory c, double delta_bytes) {
    live_[static_cast<int>(c)] += delta_bytes;
    json args;
    for (int i = 0; i < anvil::kNumMemCategories; ++i)
      args[anvil::category_name(static_cast<anvil::MemCategory>(i))] = std::llround(live_[i]);
    events_.push_back({{"ph", "C"}, {"name", "memory"}, {"ts", at_ms * 1000}, {"pid", 0}, {"args", args}});
  }
  std::string dump() const { return json{{"traceEvents", events_}, {"otherData", {{"step", step_}}}}.dump(1); }

 private:
  int step_;
  json events_ = json::array();
  std::array<double, anvil::kNumMemCategories> live_{};
};

std::string step_trace(int step) {
  using anvil::MemCategory;
  constexpr auto act = MemCategory::activations, ws = MemCategory::workspace, grad = MemCategory::gradients,
                 opt = MemCategory::optimizer_state, param = MemCategory::parameters;
  TraceWriter t(step);
  t.memory(0, param, 35.3 * kMiB);
  if (step > 1) t.memory(0, opt, 47 * kMiB);
  t.span("step", "step", 0, 400);
  t.span("data", "data", 0.5, 7.5);
  t.memory(2, act, 0.25 * kMiB);
  t.span("forward", "forward", 8, 120);
  t.span("tok_embeddings.forward", "forward", 8, 5);
  t.memory(10, act, 4 * kMiB);
  for (int i = 0; i < 4; ++i) {
    const double s = 13 + 28 * i;
    t.span("layers." + std::to_string(i) + ".forward", "forward", s, 28);
    t.memory(s + 3, ws, 6 * kMiB);
    for (int k = 1; k <= 4; ++k) t.memory(s + 5 * k, act, 5 * kMiB);
    t.memory(s + 24, ws, -6 * kMiB);
  }
  t.span("norm.forward", "forward", 125, 3);
  t.memory(126, act, 4 * kMiB);
  t.span("loss", "loss", 128, 32);
  t.memory(130, ws, 16 * kMiB);
  t.memory(156, ws, -16 * kMiB);
  t.span("backward", "backward", 160, 192);
  t.span("norm.backward", "backward", 160, 4);
  t.memory(161, grad, 0.01 * kMiB);
  t.memory(163, act, -4 * kMiB);
  for (int k = 0; k < 4; ++k) {
    const int layer = 3 - k;
    const double s = 164 + 44 * k;
    const std::string name = "layers." + std::to_string(layer);
    t.span(name + ".backward", "backward", s, 44);
    t.span(name + ".recompute", "recompute", s + 2, 10);
    t.memory(s + 4, act, 6 * kMiB);
    t.memory(s + 10, act, 3 * kMiB);
    t.memory(s + 14, grad, 5.5 * kMiB);
    t.memory(s + 16, ws, 8 * kMiB);
    t.memory(s + 20, act, -12 * kMiB);
    t.memory(s + 28, act, -9 * kMiB);
    t.memory(s + 36, act, -8 * kMiB);
    t.memory(s + 38, ws, -8 * kMiB);
  }
  t.span("tok_embeddings.backward", "backward", 340, 12);
  t.memory(344, grad, 1.49 * kMiB);
  t.memory(350, act, -4 * kMiB);
  t.span("optimizer", "optimizer", 352, 44);
  t.span("clip_grad_norm", "optimizer", 352, 6);
  t.span("adamw", "optimizer", 358, 34);
  if (step == 1)
    for (int k = 0; k < 8; ++k) t.memory(359 + k, opt, 47 * kMiB / 8);
  for (int k = 0; k < 4; ++k) t.memory(392 + k, grad, -23.5 * kMiB / 4);
  t.memory(397, act, -0.25 * kMiB);
  t.span("prefetch", "data", 140, 35, 2);
  return t.dump();
}

std::string snapshot_json(int step) {
  json largest = json::array();
  auto add = [&](const std::string& name, const char* cat, double mib, const std::string& phase) {
    largest.push_back({{"name", name}, {"category", cat}, {"bytes", std::llround(mib * kMiB)}, {"phase", phase}});
  };
  // At the peak of step 1 (the loss head's workspace, early in the backward), in no particular order: the reader sorts.
  add("tok_embeddings.weight", "parameters", 8, "init");
  add("loss.logits_chunk", "workspace", 16, "loss");
  add("output.weight", "parameters", 8, "init");
  for (int layer = 0; layer < 4; ++layer) {
    const std::string l = "layers." + std::to_string(layer);
    add(l + ".feed_forward.w1_out", "activations", 6, l + ".forward");
    add(l + ".feed_forward.w3_out", "activations", 6, l + ".forward");
    add(l + ".attention.q", "activations", 2, l + ".forward");
    add(l + ".attention.kv", "activations", 2, l + ".forward");
    add(l + ".attention_norm", "activations", 1.5, l + ".forward");
  }
  add("layers.3.feed_forward.w2.weight.grad", "gradients", 2, "layers.3.backward");
  return json{{"step", step},
              {"reason", "peak"},
              {"peak_bytes", std::llround(142.1 * kMiB)},
              {"by_category",
               {{"parameters", 35.3 * kMiB},
                {"gradients", 5.5 * kMiB},
                {"optimizer_state", 0},
                {"activations", 86.8 * kMiB},
                {"communication", 0},
                {"workspace", 16 * kMiB}}},
              {"largest", largest}}
      .dump(1);
}

// A dump folder as a profiled run leaves it: traces and snapshots in a subfolder.
fs::path make_dump(const std::string& name, bool with_traces = true) {
  const fs::path dir = fresh_folder(name);
  write_text(dir / "metrics.jsonl", metrics_jsonl());
  if (with_traces) {
    write_text(dir / "profile" / "step-1.trace.json", step_trace(1));
    write_text(dir / "profile" / "step-3.trace.json", step_trace(3));
    write_text(dir / "profile" / "step-1.snapshot.json", snapshot_json(1));
  }
  return dir;
}

// ------------------------------------------------------------ headless Chromium

bool have_chromium() { return std::system("command -v chromium >/dev/null 2>&1") == 0; }

// Chromium's stdout (stderr carries dbus and GPU noise and is dropped).
std::string chromium(const std::string& args) {
  const fs::path profile = anvil::testing::scratch_root() / "report_test" / "chromium-profile";
  const std::string cmd =
      "timeout 180 chromium --headless --no-sandbox --disable-gpu --hide-scrollbars "
      "--user-data-dir=" +
      profile.string() + " " + args + " 2>/dev/null";
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  pclose(p);
  return out;
}

// The <svg class="chart"> elements of a page, each from its tag to </svg>.
std::vector<std::string> charts_of(const std::string& html) {
  std::vector<std::string> out;
  for (size_t at = html.find("<svg class=\"chart\""); at != std::string::npos;
       at = html.find("<svg class=\"chart\"", at + 1))
    out.push_back(html.substr(at, html.find("</svg>", at) - at));
  return out;
}

// Points on the chart's longest drawn data path (its "M"/"L" commands).
size_t most_points(const std::string& chart) {
  size_t best = 0;
  static const std::regex path(R"re(<path class="series[^"]*" d="([^"]*)")re");
  for (auto it = std::sregex_iterator(chart.begin(), chart.end(), path); it != std::sregex_iterator(); ++it) {
    const std::string d = (*it)[1];
    best = std::max<size_t>(best, std::count(d.begin(), d.end(), 'M') + std::count(d.begin(), d.end(), 'L'));
  }
  return best;
}

uint32_t big_endian32(const std::string& s, size_t at) {
  uint32_t v = 0;
  for (size_t i = 0; i < 4; ++i) v = v << 8 | static_cast<unsigned char>(s[at + i]);
  return v;
}

}  // namespace

// ------------------------------------------------------------ readers

TEST(ReportReader, LaterLineWinsForARepeatedStep) {
  const fs::path dir = make_dump("repeated", false);
  const anvil::RunMetrics m = anvil::read_metrics(dir);
  // Steps 1, 5, ..., 200 once each, though 105..120 were logged twice.
  ASSERT_EQ(m.train.size(), 41u);
  EXPECT_EQ(m.replaced_lines, 4);
  for (size_t i = 1; i < m.train.size(); ++i) ASSERT_LT(m.train[i - 1].step, m.train[i].step);
  const auto at = [&](int64_t step) {
    return *std::find_if(m.train.begin(), m.train.end(), [&](const auto& r) { return r.step == step; });
  };
  // The resumed run's lines carry the loss without the first run's +0.5.
  EXPECT_NEAR(at(110).loss, 2.9 + 5.2 * std::exp(-110 / 35.0) + 0.06 * std::sin(110 * 1.7) + 0.03 * std::sin(110 * 5.3),
              1e-12);
  EXPECT_NEAR(at(100).loss, 2.9 + 5.2 * std::exp(-100 / 35.0) + 0.06 * std::sin(100 * 1.7) + 0.03 * std::sin(100 * 5.3),
              1e-12);
  EXPECT_DOUBLE_EQ(at(5).max_active_bytes_by_category[static_cast<int>(anvil::MemCategory::optimizer_state)],
                   47 * kMiB);
  ASSERT_EQ(m.validation.size(), 4u);
  EXPECT_EQ(m.validation[1].step, 100);
  EXPECT_EQ(m.validation[1].tokens, 20480);

  // A null (how JSON writers put a NaN loss) is a gap, not an error; a repeated
  // validation step also keeps its later line.
  write_text(dir / "metrics.jsonl",
             "{\"step\":1,\"loss\":null,\"lr\":1e-3}\n"
             "{\"step\":2,\"validation_loss\":5.0}\n{\"step\":2,\"validation_loss\":4.0}\n");
  const anvil::RunMetrics n = anvil::read_metrics(dir);
  ASSERT_EQ(n.train.size(), 1u);
  EXPECT_TRUE(std::isnan(n.train[0].loss));
  EXPECT_DOUBLE_EQ(n.train[0].lr, 1e-3);
  EXPECT_TRUE(std::isnan(n.train[0].tokens_per_s));
  ASSERT_EQ(n.validation.size(), 1u);
  EXPECT_DOUBLE_EQ(n.validation[0].loss, 4.0);
}

TEST(ReportReader, MalformedLineNamesFileAndLine) {
  const fs::path dir = fresh_folder("malformed");
  const std::string path = (dir / "metrics.jsonl").string();
  write_text(dir / "metrics.jsonl", "{\"step\":1,\"loss\":8.1}\n\n{\"step\":2,\"loss\":7.9\n");
  std::string e = error_of([&] { anvil::read_metrics(dir); });
  EXPECT_NE(e.find(path + ":3: not valid JSON"), std::string::npos) << e;

  write_text(dir / "metrics.jsonl", "{\"step\":1,\"loss\":8.1}\n{\"step\":2,\"loss\":\"high\"}\n");
  e = error_of([&] { anvil::read_metrics(dir); });
  EXPECT_NE(e.find(path + ":2: \"loss\" is string"), std::string::npos) << e;

  write_text(dir / "metrics.jsonl", "[1,2]\n");
  e = error_of([&] { anvil::read_metrics(dir); });
  EXPECT_NE(e.find(path + ":1: expected a JSON object"), std::string::npos) << e;

  write_text(dir / "metrics.jsonl", "{\"step\":1.5,\"loss\":8.1}\n");
  e = error_of([&] { anvil::read_metrics(dir); });
  EXPECT_NE(e.find(path + ":1: \"step\" is 1.5, expected a whole number"), std::string::npos) << e;

  // Through the program: one line on stderr, exit code 1.
  write_text(dir / "metrics.jsonl", "{\"step\":1,\"loss\":8.1}\n{oops}\n");
  const auto out = anvil::testing::run_anvil("report " + dir.string());
  EXPECT_EQ(out.exit_code, 1);
  EXPECT_NE(out.text.find("anvil: error: " + path + ":2: not valid JSON"), std::string::npos) << out.text;
}

TEST(ReportReader, MissingFolderOrMetricsIsAnError) {
  const fs::path dir = fresh_folder("missing");
  std::string e = error_of([&] { anvil::read_metrics(dir / "nowhere"); });
  EXPECT_NE(e.find((dir / "nowhere").string() + ": no such folder"), std::string::npos) << e;
  e = error_of([&] { anvil::read_metrics(dir); });
  EXPECT_NE(e.find((dir / "metrics.jsonl").string() + ": not found"), std::string::npos) << e;
  write_text(dir / "metrics.jsonl", "");
  e = error_of([&] { anvil::read_metrics(dir); });
  EXPECT_NE(e.find("holds no training lines"), std::string::npos) << e;
  write_text(dir / "metrics.jsonl", "{\"step\":50,\"validation_loss\":4.0}\n");
  e = error_of([&] { anvil::read_metrics(dir); });
  EXPECT_NE(e.find("holds no training lines"), std::string::npos) << e;

  const auto out = anvil::testing::run_anvil("report " + (dir / "nowhere").string());
  EXPECT_EQ(out.exit_code, 1);
  EXPECT_NE(out.text.find("no such folder"), std::string::npos) << out.text;
  EXPECT_FALSE(fs::exists(dir / "nowhere" / "report.html"));
}

TEST(ReportReader, TraceSpansNestAndMemoryCountersFollowTheStep) {
  const fs::path dir = make_dump("trace");
  const std::vector<anvil::TraceFile> files = anvil::find_traces(dir);
  ASSERT_EQ(files.size(), 2u);
  EXPECT_EQ(files[0].step, 1);
  EXPECT_EQ(files[1].step, 3);
  const anvil::TraceFileStep t = anvil::read_trace(files[0]);
  EXPECT_EQ(t.main_thread, 1);
  EXPECT_EQ(t.thread_names.at(2), "loader");
  auto depth_of = [&](const std::string& name) {
    for (const auto& s : t.spans)
      if (s.name == name) return s.depth;
    return -1;
  };
  EXPECT_EQ(depth_of("step"), 0);
  EXPECT_EQ(depth_of("forward"), 1);
  EXPECT_EQ(depth_of("layers.2.forward"), 2);
  EXPECT_EQ(depth_of("layers.2.backward"), 2);
  EXPECT_EQ(depth_of("layers.2.recompute"), 3);
  EXPECT_EQ(depth_of("optimizer"), 1);
  EXPECT_EQ(depth_of("prefetch"), 0);  // its own thread
  for (size_t i = 1; i < t.spans.size(); ++i) ASSERT_LE(t.spans[i - 1].start_us, t.spans[i].start_us);

  // Step 1 creates the optimizer state and ends with the gradients freed.
  using anvil::MemCategory;
  ASSERT_GT(t.memory.size(), 50u);
  const auto& first = t.memory.front().live;
  const auto& last = t.memory.back().live;
  EXPECT_DOUBLE_EQ(first[static_cast<int>(MemCategory::parameters)], std::llround(35.3 * kMiB));
  EXPECT_EQ(first[static_cast<int>(MemCategory::optimizer_state)], 0);
  EXPECT_NEAR(last[static_cast<int>(MemCategory::optimizer_state)], 47 * kMiB, 8);
  EXPECT_NEAR(last[static_cast<int>(MemCategory::gradients)], 0, 8);
  EXPECT_NEAR(last[static_cast<int>(MemCategory::activations)], 0, 8);

  const std::vector<anvil::SnapshotFile> snaps = anvil::read_snapshots(dir);
  ASSERT_EQ(snaps.size(), 1u);
  EXPECT_EQ(snaps[0].reason, "peak");
  ASSERT_EQ(snaps[0].largest.size(), 24u);
  EXPECT_EQ(snaps[0].largest[0].name, "loss.logits_chunk");  // sorted, largest first
  EXPECT_EQ(snaps[0].largest[0].bytes, std::llround(16 * kMiB));
  EXPECT_EQ(snaps[0].largest[1].bytes, std::llround(8 * kMiB));
  EXPECT_EQ(snaps[0].largest.back().bytes, std::llround(1.5 * kMiB));

  write_text(dir / "profile" / "step-3.trace.json", "{\"traceEvents\": [");
  const std::string e = error_of([&] { anvil::read_trace(anvil::find_traces(dir)[1]); });
  EXPECT_NE(e.find((dir / "profile" / "step-3.trace.json").string() + ": not valid JSON"), std::string::npos) << e;
}

// ------------------------------------------------------------ chart helpers

TEST(SvgChart, RoundTicksAndShortLabels) {
  const anvil::svg::Ticks t = anvil::svg::nice_ticks(0, 7.3, 5);
  EXPECT_DOUBLE_EQ(t.step, 2);
  EXPECT_EQ(t.values, (std::vector<double>{0, 2, 4, 6}));
  EXPECT_EQ(anvil::svg::nice_ticks(1, 3, 6, /*whole=*/true).step, 1);  // steps are whole
  EXPECT_EQ(anvil::svg::format_tick(8e-4, 2e-4), "8e-4");
  EXPECT_EQ(anvil::svg::format_tick(1.5e-4, 5e-5), "1.5e-4");
  EXPECT_EQ(anvil::svg::format_tick(1e-3, 5e-4), "1.0e-3");  // one notation along an axis
  EXPECT_EQ(anvil::svg::format_tick(15000, 5000), "15k");
  EXPECT_EQ(anvil::svg::format_tick(2.5, 0.5), "2.5");
  EXPECT_EQ(anvil::svg::format_tick(40, 20), "40");
  EXPECT_EQ(anvil::svg::format_tick(0.05, 0.05), "0.05");

  anvil::svg::Chart c;
  c.lines.push_back({"loss", "#000", {1, 2, 3, 4, 5}, {3, 2, std::nan(""), 1.5, 1}});
  const std::string svg = anvil::svg::render(c);
  EXPECT_EQ(most_points(svg), 4u);  // two pieces of two points: the gap stays open
  EXPECT_NE(svg.find("d=\"M"), std::string::npos);
  EXPECT_EQ(std::count(svg.begin(), svg.end(), 'M'), 2);  // one move per piece, nothing else spells M
}

// ------------------------------------------------------------ the page

TEST(ReportPage, DefaultTraceIsStep1ElseTheFirstTracedStep) {
  const fs::path dir = make_dump("pick");
  std::string page = anvil::render_report({dir, {}, {}});
  EXPECT_NE(page.find("Memory during step 1<"), std::string::npos);
  EXPECT_NE(page.find("Also traced: step(s) 3"), std::string::npos);
  page = anvil::render_report({dir, {}, 3});
  EXPECT_NE(page.find("Memory during step 3<"), std::string::npos);
  const std::string e = error_of([&] { anvil::render_report({dir, {}, 7}); });
  EXPECT_NE(e.find("no trace of step 7"), std::string::npos) << e;
  EXPECT_NE(e.find("traced steps: 1, 3"), std::string::npos) << e;

  fs::remove(dir / "profile" / "step-1.trace.json");
  write_text(dir / "profile" / "rank-0" / "step-12.trace.json", step_trace(12));
  page = anvil::render_report({dir, {}, {}});
  EXPECT_NE(page.find("Memory during step 3<"), std::string::npos);
}

TEST(ReportPage, WithoutTracesOrSnapshotsThePageSaysSo) {
  const fs::path dir = make_dump("no_traces", false);
  const auto out = anvil::testing::run_anvil("report " + dir.string() + " --output " + (dir / "r.html").string());
  ASSERT_EQ(out.exit_code, 0) << out.text;
  EXPECT_EQ(out.text, (dir / "r.html").string() + "\n");
  const std::string page = read_text(dir / "r.html");
  EXPECT_NE(page.find("No step trace"), std::string::npos);
  EXPECT_EQ(page.find("Largest tensors"), std::string::npos);
  EXPECT_EQ(charts_of(page).size(), 6u);
}

TEST(ReportPage, RendersInHeadlessChromiumWithEveryChartDrawn) {
  ASSERT_TRUE(have_chromium()) << "chromium is not installed; scripts/setup.sh installs it (apt-get install "
                                  "chromium). This test renders the report in a real browser.";
  const fs::path dir = make_dump("page");
  const auto out = anvil::testing::run_anvil("report " + dir.string());
  ASSERT_EQ(out.exit_code, 0) << out.text;
  const fs::path html = dir / "report.html";
  ASSERT_EQ(out.text, html.string() + "\n");
  const std::string page = read_text(html);
  // Self-contained: nothing fetched from anywhere.
  for (const char* external : {"http://", "https://", "<link", " src=", "@import", "url("})
    EXPECT_EQ(page.find(external), std::string::npos) << external;
  EXPECT_NE(page.find("4 line(s) of metrics.jsonl repeat a step"), std::string::npos);
  EXPECT_NE(page.find("Largest tensors at the peak of step 1"), std::string::npos);
  EXPECT_NE(page.find("4 smaller tensors not shown"), std::string::npos);

  const std::string dom = chromium("--dump-dom file://" + html.string());
  ASSERT_NE(dom.find("<body data-report-status=\"ok\""), std::string::npos)
      << "the page's script did not finish; the DOM:\n"
      << dom.substr(0, 2000);
  EXPECT_NE(dom.find("<div id=\"script-errors\" role=\"alert\"></div>"), std::string::npos)
      << dom.substr(dom.find("script-errors"), 500);
  const std::vector<std::string> charts = charts_of(dom);
  ASSERT_EQ(charts.size(), 7u);  // loss, grad norm, tokens/s, MFU, lr, memory by category, the step's memory timeline
  for (const std::string& c : charts) {
    EXPECT_GE(most_points(c), 20u) << c.substr(0, 300);
    EXPECT_NE(c.find("class=\"tick\""), std::string::npos);
  }
  // The timeline draws the step's phases under its memory areas, and marks the peak.
  const std::string& timeline = charts.back();
  for (const char* phase : {">forward<", ">loss<", ">backward<", ">optimizer<", ">layers.2.backward<"})
    EXPECT_NE(timeline.find(phase), std::string::npos) << phase;
  EXPECT_NE(timeline.find("<title>data 7.5 ms: data</title>"), std::string::npos);  // too narrow for its label
  EXPECT_NE(timeline.find("optimizer state"), std::string::npos);
  EXPECT_NE(timeline.find(">peak "), std::string::npos);

  // The hover read-out: a pointer at the right end of the loss chart reads the last step's values.
  std::string hover_page = page;
  hover_page.insert(hover_page.rfind("</body>"), R"(<script>
    var svg = document.querySelector('svg.chart'), d = JSON.parse(svg.getAttribute('data-tip'));
    var box = svg.getBoundingClientRect(), scale = box.width / svg.viewBox.baseVal.width;
    svg.dispatchEvent(new MouseEvent('mousemove', {clientX: box.left + (d.r - 1) * scale, clientY: box.top + 60 * scale}));
    var tip = document.getElementById('tip');
    document.body.dataset.hover = (tip.hidden ? 'hidden: ' : '') + tip.textContent;
  </script>)");
  write_text(dir / "hover.html", hover_page);
  const std::string hovered = chromium("--dump-dom file://" + (dir / "hover.html").string());
  const size_t at = hovered.find("data-hover=\"");
  ASSERT_NE(at, std::string::npos) << hovered.substr(0, 2000);
  const std::string readout = hovered.substr(at, hovered.find('"', at + 12) - at);
  EXPECT_NE(readout.find("data-hover=\"step 200train 2.927 loss"), std::string::npos) << readout;
  EXPECT_NE(readout.find("validation 3.117 loss"), std::string::npos) << readout;

  const fs::path png = dir / "report.png";
  fs::remove(png);
  chromium("--screenshot=" + png.string() + " --window-size=1280,2600 file://" + html.string());
  const std::string image = read_text(png);
  ASSERT_GE(image.size(), 24u) << "no screenshot at " << png;
  EXPECT_EQ(image.substr(0, 8), "\x89PNG\r\n\x1a\n");
  EXPECT_EQ(big_endian32(image, 16), 1280u);
  EXPECT_EQ(big_endian32(image, 20), 2600u);
  // A blank or nearly blank page of this size compresses to a few KB.
  EXPECT_GT(image.size(), 60'000u) << png;
}
