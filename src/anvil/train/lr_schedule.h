// Learning-rate schedule as torchtitan's: linear warm-up, a constant stretch,
// then a decay (linear, sqrt or cosine) to min_lr_factor·lr over the last
// decay_ratio of the steps.
#pragma once
#include <cstdint>
#include <string>

namespace anvil {

struct LrSchedule {
  double lr = 8e-4;
  int64_t total_steps = 1;
  int64_t warmup_steps = 0;
  double decay_ratio = -1;  // -1: decay over every step after warm-up
  std::string decay_type = "linear";
  double min_lr_factor = 0;

  // The learning rate of optimizer step `step` (counted from 1): lr times
  // factor(step), the schedule's multiplier, which every learning rate of the
  // step takes (Muon's and its AdamW groups' alike, as torchtitan's LambdaLR).
  double at(int64_t step) const { return lr * factor(step); }
  double factor(int64_t step) const;
};

}  // namespace anvil
