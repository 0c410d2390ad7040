#include "anvil/core/op_timer.h"

#include <omp.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

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

// A scope timed by the device clock, waiting for its stamps to be read.
struct Stamped {
  Key key{};
  uint32_t begin = 0, end = 0;
  int64_t parent = -1;  // the enclosing stamped scope's index
  double flops = 0;
};

struct Table {
  std::mutex mutex;
  std::map<Key, Sum> sums;
  std::vector<Stamped> stamped;  // the calls since timing was turned on, in the order they began
};

Table& table() {
  static Table t;
  return t;
}

thread_local ScopedOpTime* t_current = nullptr;
thread_local bool t_timed = false;  // this thread turned timing on
std::atomic<DeviceClock*> g_clock{nullptr};

void add(Table& t, const Key& key, double self_us, double flops) {
  Sum& s = t.sums[key];
  ++s.calls;
  s.self_us += self_us;
  s.flops += flops;
}

// Reads the stamped calls' times (waiting for the stream to pass them) and
// adds each call's self time: its own less its children's, as on the host.
void read_stamps(Table& t, DeviceClock& clock) {
  std::vector<double> elapsed(t.stamped.size()), children(t.stamped.size(), 0.0);
  for (size_t i = 0; i < t.stamped.size(); ++i) {
    const Stamped& s = t.stamped[i];
    elapsed[i] = clock.seconds_between(s.begin, s.end) * 1e6;
    if (s.parent >= 0) children[static_cast<size_t>(s.parent)] += elapsed[i];
  }
  for (size_t i = 0; i < t.stamped.size(); ++i) add(t, t.stamped[i].key, elapsed[i] - children[i], t.stamped[i].flops);
  t.stamped.clear();
  clock.clear();
}

}  // namespace

std::atomic<bool> OpTimer::enabled_{false};

void OpTimer::set_enabled(bool on) {
  t_timed = on;
  enabled_.store(on, std::memory_order_relaxed);
  DeviceClock* clock = g_clock.load();
  if (on || clock == nullptr) return;
  Table& t = table();
  std::lock_guard lock(t.mutex);
  read_stamps(t, *clock);
}

void OpTimer::set_device_clock(DeviceClock* clock) { g_clock.store(clock); }

void OpTimer::reset() {
  Table& t = table();
  std::lock_guard lock(t.mutex);
  t.sums.clear();
  t.stamped.clear();
  if (DeviceClock* clock = g_clock.load()) clock->clear();
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
  if (DeviceClock* clock = g_clock.load()) {
    Table& t = table();
    std::lock_guard lock(t.mutex);
    stamped_ = static_cast<int64_t>(t.stamped.size());
    t.stamped.push_back({Key{}, clock->stamp(), 0, parent_ ? parent_->stamped_ : -1, flops_});
    begin_us_ = 0;
    return;
  }
  begin_us_ = steady_now_us();
}

ScopedOpTime::~ScopedOpTime() {
  if (begin_us_ < 0) return;
  t_current = parent_;
  const Key key{current_phase().label, parent_ ? parent_->name_ : nullptr, name_};
  Table& t = table();
  if (stamped_ >= 0) {  // the device clock's: read when timing is turned off
    DeviceClock* clock = g_clock.load();
    std::lock_guard lock(t.mutex);
    Stamped& s = t.stamped[static_cast<size_t>(stamped_)];
    s.key = key;
    s.end = clock ? clock->stamp() : s.begin;  // the clock taken away mid-op: no time
    return;
  }
  const double elapsed = steady_now_us() - begin_us_;
  if (parent_ != nullptr) parent_->children_us_ += elapsed;
  std::lock_guard lock(t.mutex);
  add(t, key, elapsed - children_us_, flops_);
}

}  // namespace anvil
