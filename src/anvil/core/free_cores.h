// How many of this process's cores other processes leave idle. A fork-join
// parallel region waits for its slowest thread, and a thread that shares its
// core with a busy process waits for the scheduler at every region: beside one
// busy process, two threads on two cores run slower than one. So the default
// thread count is the cores found idle at start (OMP_NUM_THREADS overrides).
#pragma once
#include <string>

namespace anvil {

struct CoreLoad {
  int cores = 1;        // the cores this process may run on (its affinity mask)
  double busy = 0;      // cores' worth of time other processes used while sampled
  int free() const;     // cores minus busy, rounded to the nearest core, at least 1
};

// Samples /proc/stat over `window_ms` (this process idle meanwhile). Where
// /proc/stat cannot be read, every core counts as free.
CoreLoad sample_core_load(int window_ms = 200);

// Unless OMP_NUM_THREADS is set, lowers the OpenMP thread count to the cores
// found free, and returns a line saying so ("" when nothing changed).
std::string size_threads_to_free_cores();

}  // namespace anvil
