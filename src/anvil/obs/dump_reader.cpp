#include "anvil/obs/dump_reader.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>

#include "anvil/core/error.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace anvil {

double MemorySample::total() const { return std::accumulate(live.begin(), live.end(), 0.0); }

namespace {

void check_folder(const fs::path& folder) {
  std::error_code ec;
  ANVIL_CHECK(fs::exists(folder, ec), folder.string(), ": no such folder; give the job.dump_folder of a training run");
  ANVIL_CHECK(fs::is_directory(folder, ec), folder.string(),
              ": not a folder; give the job.dump_folder of a training run");
}

// nlohmann's messages start with "[json.exception.parse_error.101] "; the
// reader needs only what follows.
std::string parse_message(const json::exception& e) {
  const std::string s = e.what();
  const size_t close = s.find("] ");
  return close == std::string::npos ? s : s.substr(close + 2);
}

json parse_file(const fs::path& path) {
  std::ifstream in(path);
  ANVIL_CHECK(in.good(), path.string(), ": cannot be read");
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    throw Error(path.string() + ": not valid JSON (" + parse_message(e) + ")");
  }
}

// A number, or NaN when the key is absent or null (how nlohmann writes a NaN).
double number(const json& j, const char* key, const std::string& where) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return kMissing;
  ANVIL_CHECK(it->is_number(), where, ": \"", key, "\" is ", it->type_name(), ", expected a number");
  return it->get<double>();
}

int64_t whole_number(const json& j, const char* key, const std::string& where) {
  const auto it = j.find(key);
  ANVIL_CHECK(it != j.end(), where, ": \"", key, "\" is missing");
  ANVIL_CHECK(it->is_number_integer(), where, ": \"", key, "\" is ", it->dump(), ", expected a whole number");
  return it->get<int64_t>();
}

std::string text(const json& j, const char* key, const std::string& where) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return "";
  ANVIL_CHECK(it->is_string(), where, ": \"", key, "\" is ", it->type_name(), ", expected a string");
  return it->get<std::string>();
}

// Bytes per category from an object keyed by category name; other keys are
// categories this reader does not know and are left out.
CategoryBytes category_bytes(const json& j, const std::string& where, double absent) {
  CategoryBytes out;
  out.fill(absent);
  if (j.is_null()) return out;
  ANVIL_CHECK(j.is_object(), where, ": expected an object of bytes per category, found ", j.type_name());
  for (int c = 0; c < kNumMemCategories; ++c) {
    const double v = number(j, category_name(static_cast<MemCategory>(c)), where);
    if (!std::isnan(v)) out[c] = v;
  }
  return out;
}

TrainMetrics train_line(const json& j, int64_t step, const std::string& where) {
  TrainMetrics m;
  m.step = step;
  m.loss = number(j, "loss", where);
  m.grad_norm = number(j, "grad_norm", where);
  m.lr = number(j, "lr", where);
  m.tokens_per_s = number(j, "tokens_per_s", where);
  m.tflops = number(j, "tflops", where);
  m.mfu_pct = number(j, "mfu_pct", where);
  m.max_active_bytes = number(j, "max_active_bytes", where);
  m.data_loading_pct = number(j, "data_loading_pct", where);
  m.elapsed_s = number(j, "elapsed_s", where);
  if (const auto it = j.find("max_active_bytes_by_category"); it != j.end())
    m.max_active_bytes_by_category = category_bytes(*it, where + ": max_active_bytes_by_category", kMissing);
  return m;
}

// The N of "step-N<suffix>", if the file is named so.
std::optional<int64_t> step_from_name(const fs::path& path, std::string_view suffix) {
  const std::string name = path.filename().string();
  constexpr std::string_view prefix = "step-";
  if (name.size() <= prefix.size() + suffix.size() || name.rfind(prefix, 0) != 0) return std::nullopt;
  const char* first = name.data() + prefix.size();
  const char* last = name.data() + name.size() - suffix.size();
  int64_t step = 0;
  const auto [end, ec] = std::from_chars(first, last, step);
  if (ec != std::errc() || end != last) return std::nullopt;
  return step;
}

// Regular files under the folder whose names end with the suffix, by path so
// that the order does not depend on the file system.
std::vector<fs::path> files_ending_with(const fs::path& folder, std::string_view suffix) {
  std::vector<fs::path> out;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(folder, fs::directory_options::skip_permission_denied, ec);
       it != fs::recursive_directory_iterator(); it.increment(ec)) {
    if (ec) break;
    const std::string name = it->path().filename().string();
    if (it->is_regular_file(ec) && name.size() > suffix.size() && name.ends_with(suffix)) out.push_back(it->path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Depth of each span among the spans of its thread: a span lies inside every
// earlier, still open span. Timestamps are rounded to microseconds by the
// writer, so a child may end a fraction after its parent; only the start decides.
void set_depths(std::vector<TraceSpan>& spans) {
  std::sort(spans.begin(), spans.end(), [](const TraceSpan& a, const TraceSpan& b) {
    if (a.thread != b.thread) return a.thread < b.thread;
    if (a.start_us != b.start_us) return a.start_us < b.start_us;
    return a.duration_us > b.duration_us;  // the enclosing span first
  });
  std::vector<double> open_ends;
  int64_t thread = 0;
  for (size_t i = 0; i < spans.size(); ++i) {
    TraceSpan& s = spans[i];
    if (i == 0 || s.thread != thread) open_ends.clear(), thread = s.thread;
    while (!open_ends.empty() && open_ends.back() <= s.start_us) open_ends.pop_back();
    s.depth = static_cast<int>(open_ends.size());
    open_ends.push_back(s.end_us());
  }
  std::stable_sort(spans.begin(), spans.end(),
                   [](const TraceSpan& a, const TraceSpan& b) { return a.start_us < b.start_us; });
}

}  // namespace

RunMetrics read_metrics(const fs::path& dump_folder) {
  check_folder(dump_folder);
  RunMetrics run;
  run.path = (dump_folder / "metrics.jsonl").string();
  std::ifstream in(run.path);
  ANVIL_CHECK(in.good(), run.path,
              ": not found; anvil train appends to it every metrics.log_freq steps, so this folder has not "
              "logged a step (is it the run's job.dump_folder?)");
  std::map<int64_t, TrainMetrics> train;
  std::map<int64_t, ValidationMetrics> validation;
  std::string line;
  for (int64_t line_no = 1; std::getline(in, line); ++line_no) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = run.path + ":" + std::to_string(line_no);
    json j;
    try {
      j = json::parse(line);
    } catch (const json::exception& e) {
      throw Error(where + ": not valid JSON (" + parse_message(e) + ")");
    }
    ANVIL_CHECK(j.is_object(), where, ": expected a JSON object, found ", j.type_name());
    // Lines of other kinds (without a step, or neither training nor validation) are for other readers.
    if (!j.contains("step")) continue;
    const int64_t step = whole_number(j, "step", where);
    if (j.contains("loss")) {
      run.replaced_lines += train.count(step);
      train[step] = train_line(j, step, where);
    } else if (j.contains("validation_loss")) {
      run.replaced_lines += validation.count(step);
      const auto tokens = j.find("validation_tokens");
      validation[step] = {step, number(j, "validation_loss", where),
                          tokens == j.end() ? 0 : whole_number(j, "validation_tokens", where)};
    }
  }
  ANVIL_CHECK(!train.empty(), run.path,
              ": holds no training lines (JSON objects with \"step\" and \"loss\"); let the run log its first "
              "metrics.log_freq steps");
  for (auto& [step, m] : train) run.train.push_back(m);
  for (auto& [step, m] : validation) run.validation.push_back(m);
  return run;
}

std::vector<TraceFile> find_traces(const fs::path& dump_folder) {
  check_folder(dump_folder);
  constexpr std::string_view suffix = ".trace.json";
  std::vector<TraceFile> out;
  for (const fs::path& p : files_ending_with(dump_folder, suffix)) {
    std::optional<int64_t> step = step_from_name(p, suffix);
    if (!step) {
      const json j = parse_file(p);
      const json* other = j.is_object() && j.contains("otherData") ? &j["otherData"] : nullptr;
      ANVIL_CHECK(
          other != nullptr && other->is_object() && other->contains("step") && other->at("step").is_number_integer(),
          p.string(), ": cannot tell which step this trace is of; name it step-N.trace.json or give otherData.step");
      step = other->at("step").get<int64_t>();
    }
    out.push_back({p.string(), *step});
  }
  std::stable_sort(out.begin(), out.end(), [](const TraceFile& a, const TraceFile& b) { return a.step < b.step; });
  return out;
}

TraceFileStep read_trace(const TraceFile& file) {
  TraceFileStep t;
  t.path = file.path;
  t.step = file.step;
  const json root = parse_file(file.path);
  // The trace-event format allows a bare array of events as well as {"traceEvents": [...]}.
  const json* events = root.is_array() ? &root : nullptr;
  if (root.is_object() && root.contains("traceEvents")) events = &root["traceEvents"];
  ANVIL_CHECK(events != nullptr && events->is_array(), file.path, ": expected {\"traceEvents\": [...]}");
  for (size_t i = 0; i < events->size(); ++i) {
    const json& e = (*events)[i];
    const std::string where = file.path + ": traceEvents[" + std::to_string(i) + "]";
    ANVIL_CHECK(e.is_object(), where, ": expected an object, found ", e.type_name());
    const std::string ph = text(e, "ph", where);
    const std::string name = text(e, "name", where);
    const int64_t tid = e.contains("tid") ? whole_number(e, "tid", where) : 0;
    if (ph == "X") {
      TraceSpan s{name, text(e, "cat", where), number(e, "ts", where), number(e, "dur", where), tid, 0};
      ANVIL_CHECK(!std::isnan(s.start_us) && !std::isnan(s.duration_us), where, " (", name,
                  "): a complete span needs numbers \"ts\" and \"dur\"");
      t.spans.push_back(std::move(s));
    } else if (ph == "C" && name == "memory") {
      MemorySample m;
      m.time_us = number(e, "ts", where);
      ANVIL_CHECK(!std::isnan(m.time_us), where, ": a memory counter needs a number \"ts\"");
      m.live = category_bytes(e.contains("args") ? e["args"] : json(), where + ": args", 0.0);
      t.memory.push_back(m);
    } else if (ph == "M" && name == "thread_name" && e.contains("args")) {
      t.thread_names[tid] = text(e["args"], "name", where);
    }
  }
  set_depths(t.spans);
  std::stable_sort(t.memory.begin(), t.memory.end(),
                   [](const MemorySample& a, const MemorySample& b) { return a.time_us < b.time_us; });
  // The step span's thread runs the phases; without one, a thread named "main".
  const auto step_span =
      std::find_if(t.spans.begin(), t.spans.end(), [](const TraceSpan& s) { return s.category == "step"; });
  if (step_span != t.spans.end()) {
    t.main_thread = step_span->thread;
  } else if (const auto main = std::find_if(t.thread_names.begin(), t.thread_names.end(),
                                            [](const auto& kv) { return kv.second == "main"; });
             main != t.thread_names.end()) {
    t.main_thread = main->first;
  } else if (!t.spans.empty()) {
    t.main_thread = t.spans.front().thread;
  }
  return t;
}

std::vector<SnapshotFile> read_snapshots(const fs::path& dump_folder) {
  check_folder(dump_folder);
  constexpr std::string_view suffix = ".snapshot.json";
  std::vector<SnapshotFile> out;
  for (const fs::path& p : files_ending_with(dump_folder, suffix)) {
    const json j = parse_file(p);
    const std::string where = p.string();
    ANVIL_CHECK(j.is_object(), where, ": expected a JSON object, found ", j.type_name());
    SnapshotFile s;
    s.path = where;
    const std::optional<int64_t> named = step_from_name(p, suffix);
    s.step = j.contains("step") || !named ? whole_number(j, "step", where) : *named;
    s.reason = text(j, "reason", where);
    s.peak_bytes = number(j, "peak_bytes", where);
    if (j.contains("by_category")) s.by_category = category_bytes(j["by_category"], where + ": by_category", 0.0);
    if (j.contains("largest")) {
      ANVIL_CHECK(j["largest"].is_array(), where, ": \"largest\" is ", j["largest"].type_name(), ", expected an array");
      for (size_t i = 0; i < j["largest"].size(); ++i) {
        const json& e = j["largest"][i];
        const std::string at = where + ": largest[" + std::to_string(i) + "]";
        ANVIL_CHECK(e.is_object(), at, ": expected an object, found ", e.type_name());
        SnapshotTensor tensor{text(e, "name", at), text(e, "category", at), text(e, "phase", at),
                              number(e, "bytes", at)};
        ANVIL_CHECK(!std::isnan(tensor.bytes), at, ": \"bytes\" is missing");
        s.largest.push_back(std::move(tensor));
      }
    }
    std::stable_sort(s.largest.begin(), s.largest.end(),
                     [](const SnapshotTensor& a, const SnapshotTensor& b) { return a.bytes > b.bytes; });
    out.push_back(std::move(s));
  }
  std::stable_sort(out.begin(), out.end(),
                   [](const SnapshotFile& a, const SnapshotFile& b) { return a.step < b.step; });
  return out;
}

}  // namespace anvil
