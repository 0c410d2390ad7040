#include "anvil/distributed/comm_tracker.h"

namespace anvil {


int CommTracker::start(const char* label, int layer, CommOp op, uint64_t payload_bytes, int group_size) {
  const uint64_t bytes = comm_bytes(op, payload_bytes, group_size);
  ops_.push_back({label, layer, bytes, steady_now_us(), true});
  stats_.bytes += bytes;
  ++stats_.collectives;
  return static_cast<int>(ops_.size()) - 1;
}

void CommTracker::done(int id) {
  Op& op = ops_.at(static_cast<size_t>(id));
  if (!op.open) return;
  op.open = false;
  const double end_us = steady_now_us();
  stats_.in_flight_s += (end_us - op.start_us) * 1e-6;
  Profiler& p = Profiler::instance();
  if (p.recording())
    p.add({{op.label, op.layer}, SpanCategory::communication, p.track("collectives in flight"), op.start_us, end_us,
           op.bytes});
}

CommTracker::Blocked::~Blocked() {
  const double end_us = steady_now_us();
  t_.stats_.blocked_s += (end_us - begin_us_) * 1e-6;
  Profiler& p = Profiler::instance();
  if (p.recording())
    p.add({{"comm.blocked", -1}, SpanCategory::communication, p.track("blocked on collectives"), begin_us_, end_us});
}

CommStats CommTracker::take() {
  const CommStats s = stats_;
  stats_ = {};
  ops_.clear();
  return s;
}

}  // namespace anvil
