// An allocation log: every allocation and free of a stretch of a run, in
// order, one JSON object per line ({"event": "alloc" | "free", "tag",
// "category", "bytes"}). The trainer writes one for the step
// profiling.allocation_log_step names, on every rank; tests hold the
// estimator's dry run of that rank to it, event by event.
#pragma once
#include <string>
#include <vector>

#include "anvil/core/allocator.h"

namespace anvil {

void write_allocation_log(const std::string& path, const std::vector<MemEvent>& events);
// Throws anvil::Error naming the file and line of anything malformed.
std::vector<MemEvent> read_allocation_log(const std::string& path);

}  // namespace anvil
