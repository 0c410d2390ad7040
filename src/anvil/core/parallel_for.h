// Parallel-for over the cores. OpenMP underneath: oneDNN (Debian's build) uses
// the same OpenMP runtime, so kernels and matrix products share one thread pool
// instead of two pools stalling each other.
#pragma once
#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "anvil/core/dry_run.h"

namespace anvil {

inline int num_threads() { return omp_get_max_threads(); }
inline void set_num_threads(int n) { omp_set_num_threads(n); }

// Calls fn(lo, hi) on contiguous, disjoint chunks covering [begin, end).
// Chunks hold at least `grain` items, so tiny loops stay on one thread.
// In a dry run (core/dry_run.h) it calls nothing: the ops' arithmetic runs in
// parallel_for bodies, and their allocations outside them.
template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, F&& fn) {
  const int64_t n = end - begin;
  if (n <= 0 || dry_run()) return;
  const int64_t max_chunks = std::max<int64_t>(1, n / std::max<int64_t>(1, grain));
  const int threads = static_cast<int>(std::min<int64_t>(num_threads(), max_chunks));
  if (threads <= 1 || omp_in_parallel()) {
    fn(begin, end);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num();
    const int64_t lo = begin + n * t / threads;
    const int64_t hi = begin + n * (t + 1) / threads;
    if (lo < hi) fn(lo, hi);
  }
}

}  // namespace anvil
