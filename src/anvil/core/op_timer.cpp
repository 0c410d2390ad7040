#include "anvil/core/op_timer.h"

#include <omp.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>

#include "anvil/core/profiler.h"

namespace anvil {

namespace {

// Keys are the literals' addresses: cheap to compare on every op's exit.
using Key = std::tuple<const char*, const char*, const char*>;  // phase, parent, op
struct Sum {
  int64_t calls = 0;
  double self_us = 0;
  double flops = 0;
};

struct Table {
  std::mutex mutex;
  std::map<Key, Sum> sums;
};

Table& table() {
  static Table t;
  return t;
}

thread_local ScopedOpTime* t_current = nullptr;
thread_local bool t_timed = false;  // this thread turned timing on

}  // namespace

std::atomic<bool> OpTimer::enabled_{false};

void OpTimer::set_enabled(bool on) {
  t_timed = on;
  enabled_.store(on, std::memory_order_relaxed);
}

void OpTimer::reset() {
  Table& t = table();
  std::lock_guard lock(t.mutex);
  t.sums.clear();
}

std::vector<OpTimeRow> OpTimer::rows() {
  Table& t = table();
  std::vector<OpTimeRow> out;
  {
    std::lock_guard lock(t.mutex);
    for (const auto& [key, sum] : t.sums) {
      const auto& [phase, parent, op] = key;
      out.push_back({phase ? phase : "", parent ? parent : "", op, sum.calls, sum.self_us * 1e-6, sum.flops});
    }
  }
  std::sort(out.begin(), out.end(),
            [](const OpTimeRow& a, const OpTimeRow& b) { return a.self_seconds > b.self_seconds; });
  return out;
}

ScopedOpTime::ScopedOpTime(const char* name, double flops) : name_(name), flops_(flops) {
  if (!OpTimer::enabled() || !t_timed || omp_in_parallel()) return;
  parent_ = t_current;
  t_current = this;
  begin_us_ = steady_now_us();
}

ScopedOpTime::~ScopedOpTime() {
  if (begin_us_ < 0) return;
  const double elapsed = steady_now_us() - begin_us_;
  t_current = parent_;
  if (parent_ != nullptr) parent_->children_us_ += elapsed;
  const Key key{current_phase().label, parent_ ? parent_->name_ : nullptr, name_};
  Table& t = table();
  std::lock_guard lock(t.mutex);
  Sum& s = t.sums[key];
  ++s.calls;
  s.self_us += elapsed - children_us_;
  s.flops += flops_;
}

}  // namespace anvil
