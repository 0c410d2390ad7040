// A clean stop on Ctrl-C: SIGINT, or SIGTERM (what mpirun sends every rank
// when it gets Ctrl-C, and what schedulers send), caught while training and
// acted on at the next micro-batch boundary; under MPI every rank stops at the
// same one.
//
// The signals are taken by a thread of their own (sigtimedwait) and blocked
// in the trainer's thread and the OpenMP workers, so no compute thread is ever
// interrupted by a handler. With the handler running on whichever thread the
// signal reached, about one Ctrl-C in five on a 2-core AVX2 host corrupted the
// heap in the middle of a oneDNN product (glibc: "corrupted size vs.
// prev_size"); blocking the signals in the workers alone did not stop it, and
// with the trainer's thread blocked too, 45 Ctrl-Cs in a row stopped cleanly.
// A thread made before training started that does not block them (an MPI
// library's) still runs the plain flag-setting handler.
#pragma once
#include <signal.h>

#include <atomic>
#include <thread>

#include "anvil/train/parallel_dims.h"

namespace anvil {

class StopSignals {
 public:
  // Blocks the signals in this thread and the OpenMP workers, starts the
  // thread that takes them, installs the handlers (and forgets an earlier
  // run's signal).
  StopSignals();
  // Stops that thread; restores the masks and the handlers that were there before.
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  // Whether any rank has caught a stop signal: collective over the world (every
  // rank must ask equally often), so all ranks get the same answer.
  bool requested(const ParallelDims& par);
  // The signal of the last positive answer, agreed over the ranks.
  int signal() const { return signal_; }

 private:
  void (*previous_int_)(int);
  void (*previous_term_)(int);
  sigset_t previous_mask_;
  std::atomic<bool> done_{false};
  std::thread taker_;
  int signal_ = 0;
};

}  // namespace anvil
