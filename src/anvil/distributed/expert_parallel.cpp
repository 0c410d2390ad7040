#include "anvil/distributed/expert_parallel.h"

#include <climits>
#include <cmath>

#include "anvil/core/dry_run.h"
#include "anvil/core/error.h"

namespace anvil {

std::vector<int64_t> MpiExpertExchange::exchange_counts(const std::vector<int64_t>& counts) {
  const int64_t n = group_.size(), per_rank = static_cast<int64_t>(counts.size()) / n;
  ANVIL_ASSERT(per_rank * n == static_cast<int64_t>(counts.size()), counts.size(), " expert counts over ", n,
               " ranks");
  const Tensor out = Tensor::empty({n * per_rank, 1}, DType::i32, MemCategory::communication, "moe.counts_out");
  const Tensor in = Tensor::empty({n * per_rank, 1}, DType::i32, MemCategory::communication, "moe.counts_in");
  const bool dry = dry_run();
  for (size_t i = 0; i < counts.size(); ++i) {
    ANVIL_ASSERT(counts[i] >= 0 && counts[i] <= INT_MAX, "expert count ", counts[i]);
    if (!dry) out.data<int32_t>()[i] = static_cast<int32_t>(counts[i]);
  }
  const std::vector<int64_t> rows(static_cast<size_t>(n), per_rank);
  group_.all_to_all_v(out, rows, in, rows);
  if (dry) {  // every source sends this rank's experts what this rank sends them, times the load
    const int64_t me = group_.rank();
    std::vector<int64_t> assumed(counts.size());
    for (int64_t src = 0; src < n; ++src)
      for (int64_t j = 0; j < per_rank; ++j)
        assumed[static_cast<size_t>(src * per_rank + j)] = static_cast<int64_t>(
            std::ceil(static_cast<double>(counts[static_cast<size_t>(me * per_rank + j)]) * dry_load_));
    return assumed;
  }
  std::vector<int64_t> got(counts.size());
  for (size_t i = 0; i < got.size(); ++i) got[i] = in.data<int32_t>()[i];
  return got;
}

}  // namespace anvil
