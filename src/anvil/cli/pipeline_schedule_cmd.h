// `anvil pipeline-schedule`: a pipeline schedule (named, or a CSV file) for P
// ranks and m micro-batches, checked and shown before any training run —
// every rank's actions, the micro-batches each rank holds at once, and the
// bubble under unit costs (F = I = W = 1, B = 2) — or written as CSV to edit.
#pragma once
#include <string>
#include <vector>

namespace anvil {

// The CLI entry; bad usage and invalid schedules throw anvil::Error.
int pipeline_schedule_command(const std::vector<std::string>& args);

}  // namespace anvil
