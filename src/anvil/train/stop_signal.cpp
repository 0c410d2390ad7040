#include "anvil/train/stop_signal.h"

#include <omp.h>
#include <pthread.h>

#include <csignal>
#include <ctime>

#include "anvil/distributed/deadline.h"

namespace anvil {

namespace {
// The signal that asked the run to stop.
volatile std::sig_atomic_t g_interrupted = 0;
void on_stop_signal(int sig) {
  g_interrupted = sig;
  note_stop_signal(sig);
}

sigset_t stop_set() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  return set;
}

// `how` (SIG_BLOCK or SIG_UNBLOCK) the stop signals in every OpenMP worker
// (each keeps its mask across parallel regions; workers made later inherit
// the trainer thread's).
void mask_in_workers(int how) {
  const sigset_t set = stop_set();
#pragma omp parallel
  pthread_sigmask(how, &set, nullptr);
}
}  // namespace

StopSignals::StopSignals() {
  g_interrupted = 0;
  previous_int_ = std::signal(SIGINT, on_stop_signal);
  previous_term_ = std::signal(SIGTERM, on_stop_signal);
  const sigset_t set = stop_set();
  pthread_sigmask(SIG_BLOCK, &set, &previous_mask_);
  mask_in_workers(SIG_BLOCK);
  taker_ = std::thread([this, set] {
    const timespec tick{0, 100'000'000};  // 0.1 s: how soon the destructor's stop is seen
    while (!done_.load()) {
      const int sig = sigtimedwait(&set, nullptr, &tick);
      if (sig > 0) on_stop_signal(sig);
    }
  });
}

StopSignals::~StopSignals() {
  done_ = true;
  taker_.join();
  mask_in_workers(SIG_UNBLOCK);
  pthread_sigmask(SIG_SETMASK, &previous_mask_, nullptr);
  std::signal(SIGINT, previous_int_);
  std::signal(SIGTERM, previous_term_);
}

bool StopSignals::requested(const ParallelDims& par) {
  const int caught = g_interrupted;
  signal_ = par.max_over_world(caught);
  return signal_ != 0;
}

}  // namespace anvil
