#include "anvil/core/free_cores.h"

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "anvil/core/error.h"
#include "anvil/core/parallel_for.h"

namespace anvil {

namespace {

struct CpuTimes {
  unsigned long long idle = 0, total = 0;
};

// Per-CPU jiffies from /proc/stat ("cpuN user nice system idle iowait irq softirq steal ..."), by CPU number.
std::vector<CpuTimes> read_cpu_times() {
  std::vector<CpuTimes> out;
  std::ifstream in("/proc/stat");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("cpu", 0) != 0 || line.size() < 4 || line[3] < '0' || line[3] > '9') continue;
    std::istringstream fields(line.substr(3));
    size_t cpu = 0;
    fields >> cpu;
    CpuTimes t;
    unsigned long long v = 0;
    for (int i = 0; i < 8 && fields >> v; ++i) {
      t.total += v;
      if (i == 3 || i == 4) t.idle += v;  // idle, iowait
    }
    if (out.size() <= cpu) out.resize(cpu + 1);
    out[cpu] = t;
  }
  return out;
}

}  // namespace

int CoreLoad::free() const { return std::max(1, cores - static_cast<int>(std::lround(busy))); }

CoreLoad sample_core_load(int window_ms) {
  cpu_set_t mask;
  CPU_ZERO(&mask);
  std::vector<int> mine;
  if (sched_getaffinity(0, sizeof mask, &mask) == 0)
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &mask)) mine.push_back(c);
  CoreLoad load;
  load.cores = std::max<int>(1, static_cast<int>(mine.size()));
  const std::vector<CpuTimes> before = read_cpu_times();
  std::this_thread::sleep_for(std::chrono::milliseconds(window_ms));
  const std::vector<CpuTimes> after = read_cpu_times();
  for (const int c : mine) {
    const auto i = static_cast<size_t>(c);
    if (i >= before.size() || i >= after.size() || after[i].total <= before[i].total) continue;
    const double total = static_cast<double>(after[i].total - before[i].total);
    const double idle = static_cast<double>(after[i].idle - before[i].idle);
    load.busy += std::clamp(1.0 - idle / total, 0.0, 1.0);
  }
  return load;
}

std::string size_threads_to_free_cores() {
  if (std::getenv("OMP_NUM_THREADS") != nullptr) return "";
  const CoreLoad load = sample_core_load();
  const int before = num_threads(), threads = std::min(before, load.free());
  if (threads >= before) return "";
  set_num_threads(threads);
  char line[200];
  std::snprintf(line, sizeof line,
                "other processes kept %.1f of this machine's %d cores busy at start: %d OpenMP thread%s, not %d "
                "(OMP_NUM_THREADS overrides)",
                load.busy, load.cores, threads, threads == 1 ? "" : "s", before);
  return line;
}

}  // namespace anvil
