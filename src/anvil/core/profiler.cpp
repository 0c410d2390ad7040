#include "anvil/core/profiler.h"

#include <unistd.h>

#include <chrono>
#include <cstdlib>

namespace anvil {

namespace {
thread_local Phase t_phase;
thread_local int t_thread_index = -1;
}  // namespace

const char* span_category_name(SpanCategory c) {
  switch (c) {
    case SpanCategory::step: return "step";
    case SpanCategory::data: return "data";
    case SpanCategory::forward: return "forward";
    case SpanCategory::backward: return "backward";
    case SpanCategory::recompute: return "recompute";
    case SpanCategory::loss: return "loss";
    case SpanCategory::optimizer: return "optimizer";
    case SpanCategory::checkpoint: return "checkpoint";
    case SpanCategory::communication: return "communication";
  }
  return "?";
}

std::string phase_name(Phase p) {
  if (p.empty()) return "";
  if (p.layer < 0) return p.label;
  return "layers." + std::to_string(p.layer) + "." + p.label;
}

Phase current_phase() { return t_phase; }

namespace {
// A test hook: ANVIL_FAULT_CLOCK_SKEW=<host>:<µs> moves this clock by that
// much in the processes of that host, as another machine's clock would be
// (the multi-host test's hosts share one kernel, so one clock).
double clock_skew_us() {
  const char* v = std::getenv("ANVIL_FAULT_CLOCK_SKEW");
  if (v == nullptr) return 0;
  const std::string s = v;
  const size_t colon = s.rfind(':');
  char host[256] = {};
  if (colon == std::string::npos || ::gethostname(host, sizeof host - 1) != 0 || s.substr(0, colon) != host) return 0;
  return std::strtod(s.c_str() + colon + 1, nullptr);
}
}  // namespace

double steady_now_us() {
  using namespace std::chrono;
  static const double skew = clock_skew_us();
  return duration<double, std::micro>(steady_clock::now().time_since_epoch()).count() + skew;
}

Profiler& Profiler::instance() {
  static Profiler p;
  return p;
}

void Profiler::start() {
  std::lock_guard lock(mutex_);
  spans_.clear();
  recording_.store(true, std::memory_order_relaxed);
}

void Profiler::stop() { recording_.store(false, std::memory_order_relaxed); }

std::vector<SpanRecord> Profiler::spans() const {
  std::lock_guard lock(mutex_);
  return spans_;
}

std::vector<std::string> Profiler::thread_names() const {
  std::lock_guard lock(mutex_);
  return thread_names_;
}

int Profiler::thread_index() {
  if (t_thread_index < 0) {
    std::lock_guard lock(mutex_);
    t_thread_index = static_cast<int>(thread_names_.size());
    thread_names_.push_back(t_thread_index == 0 ? "main" : "thread " + std::to_string(t_thread_index));
  }
  return t_thread_index;
}

int Profiler::track(const std::string& name) {
  std::lock_guard lock(mutex_);
  for (size_t i = 0; i < thread_names_.size(); ++i)
    if (thread_names_[i] == name) return static_cast<int>(i);
  thread_names_.push_back(name);
  return static_cast<int>(thread_names_.size()) - 1;
}

void Profiler::set_thread_name(const std::string& name) {
  const int i = thread_index();
  std::lock_guard lock(mutex_);
  thread_names_[static_cast<size_t>(i)] = name;
}

void Profiler::add(const SpanRecord& s) {
  std::lock_guard lock(mutex_);
  if (recording_.load(std::memory_order_relaxed)) spans_.push_back(s);
}

ScopedPhase::ScopedPhase(SpanCategory category, const char* label, int layer)
    : previous_(t_phase), phase_{label, layer}, category_(category) {
  t_phase = phase_;
  if (Profiler::instance().recording()) begin_us_ = steady_now_us();
}

ScopedPhase::~ScopedPhase() {
  t_phase = previous_;
  if (begin_us_ >= 0) {
    Profiler& p = Profiler::instance();
    p.add({phase_, category_, p.thread_index(), begin_us_, steady_now_us()});
  }
}

}  // namespace anvil
