// The single-process training loop: data, model, AdamW with clipping and an LR
// schedule, gradient accumulation, mixed precision, activation checkpointing,
// metrics, and a clean stop on Ctrl-C or a non-finite loss.
#pragma once
#include "anvil/train/config.h"

namespace anvil {

struct TrainResult {
  int64_t steps_done = 0;
  double first_loss = 0;
  double last_loss = 0;
  bool interrupted = false;
};

// Trains as `cfg` says. Throws anvil::Error (before allocating anything, where
// possible) for a configuration that cannot run.
TrainResult train(const JobConfig& cfg);

}  // namespace anvil
