// What a run shows about itself, end to end through the anvil program: the
// Chrome trace of a profiled step (threads, nested spans for every block's
// forward, backward and recompute, the memory counter telling seed 002's story),
// the memory snapshot at its peak, TensorBoard files, and the snapshot dumped
// when memory runs out.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "anvil/model/args.h"
#include "anvil/model/llama.h"
#include "anvil/model/params.h"
#include "test_util.h"

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

fs::path workdir(const std::string& name) {
  const fs::path dir = anvil::testing::scratch_root() / ("anvil_observability_test_" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream text(dir / "text.txt");
  for (int i = 0; i < 400; ++i)
    text << "Line " << i % 17 << ": the committee's report praised the handling of the election.\n";
  return dir;
}

json read_json(const fs::path& p) {
  std::ifstream in(p);
  EXPECT_TRUE(in.good()) << p;
  return json::parse(in);
}

struct Span {
  std::string name, cat;
  double begin, end;
  int tid;
};

struct Trace {
  std::map<int, std::string> threads;
  std::vector<Span> spans;
  std::vector<std::pair<double, std::map<std::string, double>>> memory;  // (ts, bytes by category)

  const Span* find(const std::string& name) const {
    for (const Span& s : spans)
      if (s.name == name) return &s;
    return nullptr;
  }
  // The memory counter's last sample at or before t.
  double memory_at(double t, const std::string& category) const {
    double v = 0;
    for (const auto& [ts, by] : memory)
      if (ts <= t) v = by.at(category);
    return v;
  }
};

Trace parse_trace(const fs::path& p) {
  const json doc = read_json(p);
  Trace t;
  for (const json& e : doc.at("traceEvents")) {
    const std::string ph = e.at("ph");
    if (ph == "M" && e.at("name") == "thread_name") t.threads[e.at("tid").get<int>()] = e.at("args").at("name");
    if (ph == "X") {
      const double ts = e.at("ts"), dur = e.at("dur");
      t.spans.push_back({e.at("name"), e.at("cat"), ts, ts + dur, e.at("tid").get<int>()});
    }
    if (ph == "C" && e.at("name") == "memory") {
      std::map<std::string, double> by;
      for (const auto& [k, v] : e.at("args").items()) by[k] = v.get<double>();
      t.memory.emplace_back(e.at("ts").get<double>(), by);
    }
  }
  return t;
}

bool contains(const Span& outer, const Span& inner) { return outer.begin <= inner.begin && inner.end <= outer.end; }

}  // namespace

TEST(Observability, AProfiledStepShowsEveryPhaseAndTheMemoryStory) {
  const fs::path dir = workdir("trace");
  const fs::path dump = dir / "run";
  const auto out = anvil::testing::run_anvil(
      "train --training.dataset text --training.dataset_path " + (dir / "text.txt").string() +
      " --training.seq_len 64 --training.local_batch_size 2 --training.steps 2 --metrics.log_freq 1"
      " --activation_checkpoint.mode full --profiling.enable_profiling --profiling.enable_memory_snapshot"
      " --profiling.profile_freq 2 --job.dump_folder " + dump.string());
  ASSERT_EQ(out.exit_code, 0) << out.text;
  // Where things go is said at the start.
  EXPECT_NE(out.text.find("traces of step 1 and every 2-th step to " + (dump / "profile_traces").string()),
            std::string::npos) << out.text;
  EXPECT_NE(out.text.find("anvil report " + dump.string()), std::string::npos) << out.text;

  const anvil::ModelArgs args = anvil::model_flavor("llama3", "debugmodel");
  const double grad_bytes = 4.0 * static_cast<double>(anvil::padded_numel(anvil::llama_param_specs(args)));
  const Trace t = parse_trace(dump / "profile_traces" / "step-1.trace.json");

  // Threads: the main one, and the data loader's prefetch thread.
  std::set<std::string> thread_names;
  for (const auto& [tid, name] : t.threads) thread_names.insert(name);
  EXPECT_TRUE(thread_names.count("main")) << "threads named";
  EXPECT_TRUE(thread_names.count("data prefetch"));

  // Spans on each thread nest: each one lies inside the innermost open span or after it.
  std::map<int, std::vector<Span>> by_thread;
  for (const Span& s : t.spans) by_thread[s.tid].push_back(s);
  for (auto& [tid, spans] : by_thread) {
    std::sort(spans.begin(), spans.end(),
              [](const Span& a, const Span& b) { return a.begin != b.begin ? a.begin < b.begin : a.end > b.end; });
    std::vector<Span> open;
    for (const Span& s : spans) {
      while (!open.empty() && open.back().end <= s.begin) open.pop_back();
      if (!open.empty()) {
        EXPECT_TRUE(contains(open.back(), s)) << s.name << " overlaps " << open.back().name;
      }
      open.push_back(s);
    }
  }

  // Every phase is there, each block's recompute inside its backward.
  const Span* step = t.find("step");
  ASSERT_NE(step, nullptr);
  for (const char* name : {"data", "embedding.forward", "loss", "optimizer", "embedding.backward"}) {
    const Span* s = t.find(name);
    ASSERT_NE(s, nullptr) << name;
    EXPECT_TRUE(contains(*step, *s)) << name;
  }
  for (int l = 0; l < args.n_layers; ++l) {
    const std::string layer = "layers." + std::to_string(l) + ".";
    for (const char* part : {"forward", "attention.forward", "feed_forward.forward", "backward", "recompute",
                             "attention.backward", "feed_forward.backward", "attention.recompute"}) {
      ASSERT_NE(t.find(layer + part), nullptr) << layer + part;
    }
    EXPECT_TRUE(contains(*t.find(layer + "backward"), *t.find(layer + "recompute"))) << layer;
    EXPECT_EQ(t.find(layer + "recompute")->cat, "recompute");
    EXPECT_EQ(t.find(layer + "backward")->cat, "backward");
  }
  std::set<std::string> cats;
  for (const Span& s : t.spans) cats.insert(s.cat);
  for (const char* c : {"step", "data", "forward", "backward", "recompute", "loss", "optimizer"})
    EXPECT_TRUE(cats.count(c)) << c;

  // The memory story of step 1 (seed 002): no gradients or optimizer state
  // while the forward stores activations; gradients appear as the backward
  // starts; AdamW's state is created by the first optimizer step; the
  // activations are gone after it and the gradients stay for the next step
  // (zeroed there: PyTorch's zero_grad(set_to_none=False)).
  const Span& loss = *t.find("loss");
  const Span& optimizer = *t.find("optimizer");
  const Span& last_forward = *t.find("layers." + std::to_string(args.n_layers - 1) + ".forward");
  ASSERT_FALSE(t.memory.empty());
  EXPECT_EQ(t.memory.front().second.at("gradients"), 0);
  EXPECT_EQ(t.memory.front().second.at("optimizer_state"), 0);
  EXPECT_EQ(t.memory_at(last_forward.end, "gradients"), 0);
  EXPECT_GT(t.memory_at(last_forward.end, "activations"), t.memory_at(t.find("embedding.forward")->begin, "activations"));
  EXPECT_EQ(t.memory_at(loss.end, "gradients"), grad_bytes);
  EXPECT_EQ(t.memory_at(optimizer.begin, "optimizer_state"), 0);
  EXPECT_EQ(t.memory_at(optimizer.end, "optimizer_state"), 2 * grad_bytes);
  EXPECT_EQ(t.memory_at(step->end, "gradients"), grad_bytes);
  EXPECT_EQ(t.memory_at(step->end, "activations"), 0);

  // Step 2 starts with the optimizer state and the gradients in place.
  const Trace t2 = parse_trace(dump / "profile_traces" / "step-2.trace.json");
  ASSERT_FALSE(t2.memory.empty());
  EXPECT_EQ(t2.memory.front().second.at("optimizer_state"), 2 * grad_bytes);
  EXPECT_EQ(t2.memory.front().second.at("gradients"), grad_bytes);

  // The snapshot is taken at the trace's highest point and adds up.
  const json snap = read_json(dump / "memory_snapshot" / "step-1.snapshot.json");
  double trace_peak = 0;
  for (const auto& [ts, by] : t.memory) {
    double total = 0;
    for (const auto& [k, v] : by) total += v;
    trace_peak = std::max(trace_peak, total);
  }
  EXPECT_EQ(snap.at("reason"), "peak");
  EXPECT_EQ(snap.at("peak_bytes").get<double>(), trace_peak);
  double by_cat = 0;
  for (const auto& [k, v] : snap.at("by_category").items()) by_cat += v.get<double>();
  EXPECT_EQ(by_cat, trace_peak);
  // With full recomputation and a tiny batch, step 1's peak is AdamW's state
  // being created while the gradients are still live; each tensor names the
  // phase that allocated it.
  const json& largest = snap.at("largest");
  ASSERT_GE(largest.size(), 5u);
  std::map<std::string, std::string> phase_of;
  for (size_t i = 0; i < largest.size(); ++i) {
    if (i > 0) {
      EXPECT_LE(largest[i].at("bytes").get<double>(), largest[i - 1].at("bytes").get<double>());
    }
    phase_of[largest[i].at("name")] = largest[i].at("phase");
  }
  EXPECT_EQ(phase_of["adamw.exp_avg"], "optimizer") << snap.dump(1);
  EXPECT_EQ(phase_of["adamw.exp_avg_sq"], "optimizer");
  EXPECT_EQ(phase_of["params.grads_f32"], "loss");
  EXPECT_EQ(phase_of["params.master_f32"], "model.init");

  // The report reads this real dump folder (report_test renders pages in Chromium).
  const auto report = anvil::testing::run_anvil("report " + dump.string());
  ASSERT_EQ(report.exit_code, 0) << report.text;
  std::ifstream page_in(dump / "report.html");
  const std::string page((std::istreambuf_iterator<char>(page_in)), std::istreambuf_iterator<char>());
  EXPECT_NE(page.find("layers.0.attention.forward"), std::string::npos) << "the step-1 timeline names its spans";
  EXPECT_NE(page.find("optimizer state"), std::string::npos);

  // TensorBoard: one event file with the training curves (decoding is tested in tensorboard_test).
  std::vector<fs::path> events;
  for (const auto& e : fs::directory_iterator(dump / "tb")) events.push_back(e.path());
  ASSERT_EQ(events.size(), 1u);
  std::ifstream ev(events[0], std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(ev)), std::istreambuf_iterator<char>());
  for (const char* tag : {"loss/train", "lr", "grad_norm", "throughput/mfu_pct", "memory/activations"})
    EXPECT_NE(bytes.find(tag), std::string::npos) << tag;
}

TEST(Observability, RunningOutOfMemoryDumpsASnapshotOfWhatWasLive) {
#if defined(__SANITIZE_ADDRESS__)
  // AddressSanitizer maps terabytes of writable shadow memory at start, which
  // a ulimit -d makes impossible; the release build (scripts/test.sh) runs this.
  GTEST_SKIP() << "ulimit -d and AddressSanitizer's shadow memory cannot coexist";
#endif
  // The process's data (ulimit -d: its heap and private writable mappings,
  // not the code of the libraries it maps) is capped below what the 125M model
  // needs once AdamW's state is created, so a real allocation fails mid-run.
  // The fp32 weights and gradients hold 0.93 GiB (a block's bf16 cast lives
  // only while the block runs), each AdamW moment 0.46 GiB more; the rest of
  // the process (threads' stacks, oneDNN, MPI) about 0.25 GiB. The cap, 1.90
  // GiB, lets the first moment in and not the second, with about a fifth of a
  // GiB to spare either way. (An address-space cap, ulimit -v, would
  // also count the code of cuBLASLt, 0.5 GiB, in a build with the CUDA backend.)
  const fs::path dir = workdir("oom");
  const fs::path dump = dir / "run";
  const auto out = anvil::testing::run_anvil(
      "train --model.flavor 125M --training.dataset text --training.dataset_path " + (dir / "text.txt").string() +
          " --training.seq_len 32 --training.local_batch_size 1 --training.steps 2 --metrics.enable_tensorboard false"
          " --job.dump_folder " + dump.string(),
      "ulimit -d 1990000; ");
  EXPECT_EQ(out.exit_code, 1) << out.text;
  EXPECT_NE(out.text.find("out of memory allocating"), std::string::npos) << out.text;
  const fs::path snap_path = dump / "memory_snapshot" / "step-1.oom.snapshot.json";
  EXPECT_NE(out.text.find("live tensors are listed in"), std::string::npos) << out.text;
  EXPECT_NE(out.text.find(snap_path.string()), std::string::npos) << out.text;
  const json snap = read_json(snap_path);
  EXPECT_EQ(snap.at("reason"), "out_of_memory");
  EXPECT_EQ(snap.at("step"), 1);
  const json& largest = snap.at("largest");
  ASSERT_FALSE(largest.empty());
  // AdamW's second moment is the allocation that fails; what holds the memory
  // is named with the phase that allocated it.
  EXPECT_NE(out.text.find("for 'adamw.exp_avg_sq'"), std::string::npos) << out.text;
  std::map<std::string, std::string> phase_of;
  for (const json& e : largest) phase_of[e.at("name")] = e.at("phase");
  EXPECT_EQ(phase_of["adamw.exp_avg"], "optimizer") << snap.dump(1);
  EXPECT_EQ(phase_of["params.grads_f32"], "loss");
  EXPECT_EQ(phase_of["params.master_f32"], "model.init");
}
