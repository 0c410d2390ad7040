#include "anvil/core/did_you_mean.h"

#include <algorithm>
#include <cstdint>

namespace anvil {

size_t edit_distance(const std::string& a, const std::string& b) {
  // One row of the dynamic-programming table at a time.
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string nearest_word(const std::vector<std::string>& candidates, const std::string& wanted, size_t max_distance) {
  std::string best;
  size_t best_d = SIZE_MAX;
  for (const std::string& c : candidates) {
    const size_t d = edit_distance(c, wanted);
    if (d < best_d) best = c, best_d = d;
  }
  return best_d <= max_distance ? best : "";
}

}  // namespace anvil
