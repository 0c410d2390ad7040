// A clean stop on Ctrl-C: SIGINT, or SIGTERM (what mpirun sends every rank
// when it gets Ctrl-C, and what schedulers send), caught while training and
// acted on at the next micro-batch boundary; under MPI every rank stops at the
// same one.
#pragma once

#include "anvil/train/parallel_dims.h"

namespace anvil {

class StopSignals {
 public:
  // Installs the handlers (and forgets an earlier run's signal).
  StopSignals();
  // Restores the handlers that were there before.
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
  int signal_ = 0;
};

}  // namespace anvil
