#include "anvil/train/stop_signal.h"

#include <csignal>

#include "anvil/distributed/deadline.h"

namespace anvil {

namespace {
// The signal that asked the run to stop.
volatile std::sig_atomic_t g_interrupted = 0;
void on_stop_signal(int sig) {
  g_interrupted = sig;
  note_stop_signal(sig);
}
}  // namespace

StopSignals::StopSignals() {
  g_interrupted = 0;
  previous_int_ = std::signal(SIGINT, on_stop_signal);
  previous_term_ = std::signal(SIGTERM, on_stop_signal);
}

StopSignals::~StopSignals() {
  std::signal(SIGINT, previous_int_);
  std::signal(SIGTERM, previous_term_);
}

bool StopSignals::requested(const ParallelDims& par) {
  signal_ = par.max_over_world(static_cast<int>(g_interrupted));
  return signal_ != 0;
}

}  // namespace anvil
