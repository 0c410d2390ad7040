#include "anvil/core/process_memory.h"

#include <sys/resource.h>
#include <unistd.h>

#include <fstream>

namespace anvil {

size_t resident_set_bytes() {
  std::ifstream statm("/proc/self/statm");
  size_t pages_total = 0, pages_resident = 0;
  if (!(statm >> pages_total >> pages_resident)) return 0;
  return pages_resident * static_cast<size_t>(sysconf(_SC_PAGESIZE));
}

size_t peak_resident_set_bytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<size_t>(usage.ru_maxrss) * 1024;  // KiB on Linux
}

}  // namespace anvil
