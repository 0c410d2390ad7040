// The single-process training loop: data, model, the optimizer (AdamW or Muon) with clipping and an LR
// schedule, gradient accumulation, mixed precision, activation checkpointing,
// metrics, and a clean stop on Ctrl-C or a non-finite loss.
#pragma once
#include <cmath>
#include "anvil/train/config.h"

namespace anvil {

struct TrainResult {
  int64_t first_step = 1;    // > 1 after a resume
  int64_t steps_done = 0;    // the last step completed
  double resumed_loss = std::nan("");  // the resumed checkpoint's own loss (NaN: none, or not recorded)
  double first_loss = 0;     // the first step this run trained
  double last_loss = 0;
  bool interrupted = false;
};

// Trains as `cfg` says. Throws anvil::Error (before allocating anything, where
// possible) for a configuration that cannot run.
TrainResult train(const JobConfig& cfg);

}  // namespace anvil
