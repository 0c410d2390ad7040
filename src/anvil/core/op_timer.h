// Per-op time: where a training step's time goes, op by op ([profiling]
// op_times). Every op (a matrix product, attention, a norm, the optimizer's
// pass, a cast) opens a ScopedOpTime; while timing is on, its wall time and
// useful FLOPs are summed per (phase, op), so one table sums to the step.
//
// An op called inside another (a product inside the fused loss) is kept as
// its own row under the outer op, whose "self" time excludes it; calls made
// from inside an OpenMP parallel region (attention's per-tile products on
// every thread) are not timed at all: they belong to the op that opened the
// region, and timing them per thread would count the same seconds twice.
//
// Off, a ScopedOpTime costs one relaxed atomic load.
#pragma once
#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

namespace anvil {

struct OpTimeRow {
  std::string phase;   // the profiler's phase label, layer index dropped ("attention.forward"); "" outside any
  std::string parent;  // the op this one ran inside, or ""
  std::string op;      // "linear.forward", "attention.backward", ...
  int64_t calls = 0;
  double self_seconds = 0;  // wall time, minus the time of the ops called inside it
  double flops = 0;         // useful FLOPs (what the model's FLOP count credits)
};

class OpTimer {
 public:
  // Starts (or pauses) timing of the ops the calling thread runs (the
  // trainer's main thread: another thread's ops, a data loader's copies,
  // would overlap the step's time); what was summed stays until reset().
  static void set_enabled(bool on);
  static bool enabled() { return enabled_.load(std::memory_order_relaxed); }
  static void reset();
  // Every (phase, parent, op) seen since the last reset, the longest first.
  static std::vector<OpTimeRow> rows();

 private:
  static std::atomic<bool> enabled_;
};

// Times the enclosing scope as op `name` (a string literal) doing `flops` of useful work.
class ScopedOpTime {
 public:
  explicit ScopedOpTime(const char* name, double flops = 0);
  ~ScopedOpTime();
  ScopedOpTime(const ScopedOpTime&) = delete;
  ScopedOpTime& operator=(const ScopedOpTime&) = delete;

 private:
  const char* name_;
  double flops_;
  double begin_us_ = -1;  // < 0: not timed
  double children_us_ = 0;
  ScopedOpTime* parent_ = nullptr;
};

}  // namespace anvil
