// The profiler: named phases of a training step (a block's forward, its
// backward, the optimizer, data loading, ...) as nested spans per thread.
// Phases cost one thread-local store when nothing is recorded, so they stay on
// always: the tracking allocator tags every allocation with the phase that made
// it, which is what a memory snapshot reports. Spans are only kept while a step
// is being profiled (start() ... stop()); obs/trace.h writes them as a Chrome
// trace together with the allocator's timeline.
#pragma once
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace anvil {

enum class SpanCategory : uint8_t { step, data, forward, backward, recompute, loss, optimizer, checkpoint, communication };
const char* span_category_name(SpanCategory c);

// What the program is doing. `label` is a string literal; a block's phases
// carry its index, so the name reads "layers.3.attention.forward".
struct Phase {
  const char* label = nullptr;
  int layer = -1;
  bool empty() const { return label == nullptr; }
};
std::string phase_name(Phase p);

// This thread's innermost phase (empty outside any).
Phase current_phase();

struct SpanRecord {
  Phase phase;
  SpanCategory category;
  int thread;       // index into Profiler::thread_names()
  double begin_us;  // steady clock, µs (the allocator's timeline uses the same clock)
  double end_us;
  uint64_t bytes = 0;  // communication spans: bytes this rank sent
};

double steady_now_us();

class Profiler {
 public:
  static Profiler& instance();

  // Spans are recorded between start() and stop(); start() clears older ones.
  void start();
  void stop();
  bool recording() const { return recording_.load(std::memory_order_relaxed); }

  std::vector<SpanRecord> spans() const;
  std::vector<std::string> thread_names() const;

  // Names the calling thread's track ("main", "data prefetch", "checkpoint writer").
  void set_thread_name(const std::string& name);
  int thread_index();
  // A track that is not a thread (e.g. collectives in flight), by name.
  int track(const std::string& name);
  void add(const SpanRecord& s);

 private:
  Profiler() = default;
  std::atomic<bool> recording_{false};
  mutable std::mutex mutex_;
  std::vector<SpanRecord> spans_;
  std::vector<std::string> thread_names_;
};

// Enters a phase for the scope's lifetime and, while profiling, records its span.
class ScopedPhase {
 public:
  ScopedPhase(SpanCategory category, const char* label, int layer = -1);
  ~ScopedPhase();
  ScopedPhase(const ScopedPhase&) = delete;
  ScopedPhase& operator=(const ScopedPhase&) = delete;

 private:
  Phase previous_;
  Phase phase_;
  SpanCategory category_;
  double begin_us_ = -1;  // < 0: not recording
};

}  // namespace anvil
