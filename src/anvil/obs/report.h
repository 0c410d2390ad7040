// The training report: one self-contained HTML page (inline CSS and SVG, no
// network) built from a run's dump folder — loss, learning rate, throughput,
// MFU and peak memory by category over the steps, one step's memory timeline
// under its phases from a trace, and the largest tensors of a memory snapshot.
#pragma once
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

namespace anvil {

struct ReportOptions {
  std::filesystem::path dump_folder;
  std::filesystem::path output;       // empty: <dump_folder>/report.html
  std::optional<int64_t> trace_step;  // the step whose trace to chart; empty: step 1 if traced, else the first traced
};

// The page. Throws anvil::Error when metrics.jsonl is missing, empty or
// malformed, or when the asked-for trace step was not traced. Missing traces
// and snapshots are said so on the page.
std::string render_report(const ReportOptions& options);

// Renders and writes the page (whole or not at all); returns where.
std::filesystem::path write_report(const ReportOptions& options);

}  // namespace anvil
