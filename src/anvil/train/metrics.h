// The metrics log: one console line and one JSON line per logging step, with
// throughput and MFU as torchtitan defines them (FLOPs per token is predicted in
// estimate/flops.h, the CPU's peak FLOP rate is in core/cpu_peak.h).
#pragma once
#include <array>
#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "anvil/core/allocator.h"
#include "anvil/core/cpu_peak.h"
#include "anvil/core/device.h"
#include "anvil/core/dtype.h"

namespace anvil {

struct StepLog {
  int64_t step = 0;
  int64_t total_steps = 0;  // training.steps
  double eta_s = -1;        // the remaining steps at this interval's pace (-1: none left)
  double loss = 0;
  double grad_norm = 0;
  double lr = 0;
  double tokens_per_s = 0;
  double tflops = 0;
  double mfu_pct = 0;
  MemStats memory;  // peaks since the previous log line
  double data_pct = 0;
  double elapsed_s = 0;
  int world_size = 1;
  size_t max_memory_over_ranks = 0;  // the highest peak_total of any rank
  std::vector<double> tokens_per_s_by_rank, peak_mib_by_rank;  // distributed runs, by world rank
  std::vector<double> activation_peak_mib_by_rank;              // the activations category's peak, likewise
  std::vector<double> peak_rss_mib_by_rank;                     // each process's peak resident set so far
  size_t peak_rss = 0;            // this process's peak resident set so far (bytes)
  size_t untracked = 0;  // resident bytes the allocator does not see (StepLogger::measure_untracked)
  std::vector<double> untracked_mib_by_rank;
  std::vector<double> peak_reserved_mib_by_rank;  // MemStats::peak_reserved of every rank
  // Every rank's peak bytes per category over the interval (as f32: 7 digits).
  std::vector<std::array<double, kNumMemCategories>> peak_by_rank_by_category;
  // Data-parallel communication per step on this rank (distributed runs).
  double comm_bytes_per_step = 0, comm_in_flight_s = 0, comm_blocked_s = 0, comm_hidden_pct = 0;
  double comm_bytes_closed_form = 0;
  double tp_comm_bytes_per_step = 0;  // tensor-parallel collectives (activations), measured
  double pp_comm_bytes_per_step = 0;  // pipeline sends and receives, measured
  double ep_comm_bytes_per_step = 0;  // expert parallelism's all-to-alls, measured
  // Muon: its Newton-Schulz FLOPs on this rank per step, and under FSDP its
  // all-to-alls' bytes, measured and as the layout gives them.
  double optimizer_flops_per_step = 0;
  double optimizer_comm_bytes_per_step = 0, optimizer_comm_bytes_closed_form = 0;
  // A mixture-of-experts model: the load-balancing loss (the interval's last
  // step) and the routes per expert of each layer over the interval.
  int64_t moe_experts = 0;
  double moe_aux_loss = 0;
  std::vector<double> moe_routes;  // (n_layers, moe_experts)
  // The most rows one layer's experts received on this rank over the interval,
  // and that over the balanced share (MoeStepState); every rank's when distributed.
  int64_t moe_received_rows = 0;
  double moe_received_share = 0;
  std::vector<double> moe_received_rows_by_rank, moe_received_share_by_rank;
  // Live bytes per category right after the optimizer step, gradients still held.
  std::array<size_t, kNumMemCategories> live_after_optimizer{};
  // A job on a GPU: its device pool's peaks over the interval (core/device_pool.h's
  // mem_stats); `memory` above is then the host's.
  Device device = Device::cpu();
  MemStats device_memory;
};

// The console line of a logging step (every rank prints it: rank 0 to the
// console, the others to their logs). By default it fits 120 columns (a
// mixture of experts' routing goes on a second line); verbose adds the
// throughput in TFLOP/s, memory by category, data-loading share and elapsed time.
std::string step_line(const StepLog& s, bool verbose);
void print_step_line(const StepLog& s, bool verbose);
// "42s", "12m05s", "3h12m", "2d03h".
std::string duration_text(double seconds);

// The experts' load over every layer, each expert's routes over the mean
// (1.0: balanced), and the line's summary of it: a bar per expert (up to 48
// experts; ▅ the mean, █ twice it or more) and the most and least loaded.
std::vector<double> expert_load(const std::vector<double>& routes, int64_t num_experts);
std::string expert_load_summary(const std::vector<double>& load);

class MetricsLog {
 public:
  // Appends to <dump_folder>/metrics.jsonl (the folder is created), a JSON line per logging step.
  explicit MetricsLog(const std::string& dump_folder);
  void log(const StepLog& s);
  // A JSON line {"step", "validation_loss", "validation_tokens"}.
  void log_validation(int64_t step, double loss, int64_t tokens);
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::ofstream jsonl_;
};

}  // namespace anvil
