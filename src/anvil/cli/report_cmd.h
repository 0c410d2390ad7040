// `anvil report <dump_folder>`: one self-contained HTML page of a run — loss,
// learning rate, throughput, MFU and memory over the steps, one step's memory
// timeline from its trace, the largest tensors of a memory snapshot.
#pragma once
#include <string>
#include <vector>

#include "anvil/obs/report.h"

namespace anvil {

// Parses the words after `anvil report`; throws anvil::Error on bad usage.
ReportOptions parse_report_args(const std::vector<std::string>& args);

// The CLI entry: writes the page, prints its path and returns the exit code;
// bad usage and bad input throw anvil::Error.
int report_command(const std::vector<std::string>& args);

}  // namespace anvil
