#include "anvil/train/lr_schedule.h"

#include <algorithm>
#include <cmath>

#include "anvil/core/error.h"

namespace anvil {

double LrSchedule::factor(int64_t step) const {
  ANVIL_ASSERT(step >= 1);
  // Warm-up: step 1 already moves (lr/warmup), so no step is wasted at lr 0.
  if (step <= warmup_steps) return static_cast<double>(step) / static_cast<double>(warmup_steps);
  const int64_t after = total_steps - warmup_steps;
  const int64_t decay_steps =
      decay_ratio < 0 ? after : std::min<int64_t>(after, static_cast<int64_t>(std::llround(decay_ratio * total_steps)));
  const int64_t decay_start = total_steps - decay_steps;
  if (step <= decay_start || decay_steps <= 0) return 1;
  const double p = static_cast<double>(step - decay_start) / static_cast<double>(decay_steps);  // (0, 1]
  double curve;
  if (decay_type == "linear") curve = 1 - p;
  else if (decay_type == "sqrt") curve = 1 - std::sqrt(p);
  else if (decay_type == "cosine") curve = 0.5 * (1 + std::cos(M_PI * p));
  else throw Error(detail::concat("lr_scheduler.decay_type \"", decay_type, "\" is not one of: linear, sqrt, cosine"));
  return min_lr_factor + (1 - min_lr_factor) * curve;
}

}  // namespace anvil
