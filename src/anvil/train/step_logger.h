// The trainer's step log: every metrics.log_freq steps (and at the last) one
// console line, one metrics.jsonl line and the TensorBoard scalars, with
// throughput, MFU, memory peaks and communication averaged over the interval;
// the validation losses; and the closing summary.
#pragma once
#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "anvil/core/allocator.h"
#include "anvil/core/cpu_peak.h"
#include "anvil/obs/tensorboard.h"
#include "anvil/train/config.h"
#include "anvil/train/metrics.h"
#include "anvil/train/parallel_dims.h"
#include "anvil/train/parallelize.h"

namespace anvil {

struct TrainResult;

// Every rank's figures of a logged step gathered onto every rank (tokens/s,
// peaks by category, RSS, reserved bytes): a collective over the world, made
// by the trainer at each logged step and by the estimator's dry run
// (train/estimate.h) as the trainer does, for the buffers it takes.
void gather_rank_figures(const ParallelDims& par, StepLog& log);

class StepLogger {
 public:
  // Rank 0 writes the job's files: metrics.jsonl and the TensorBoard events.
  // peak and flops_per_token: what MFU is measured against.
  StepLogger(const JobConfig& cfg, const ParallelDims& par, PeakFlops peak, double flops_per_token,
             double comm_bytes_closed_form);
  // Where the files go ("(rank 0)" on the other ranks), for the console.
  void print_destinations() const;

  // Starts the clocks and the memory peak, just before the first step.
  void start();
  void add_data_seconds(double s) { data_seconds_ += s; }
  // A step's communication (counted also for a step that is then interrupted).
  void add_comm(const StepComm& c);
  // The optimizer's work per step on this rank, as the layout gives it
  // (ParallelizedModel::optimizer_flops_per_step, optimizer_bytes_per_step).
  void set_optimizer_figures(double flops_per_step, double bytes_per_step) {
    optimizer_flops_ = flops_per_step;
    optimizer_bytes_closed_form_ = bytes_per_step;
  }
  // What this rank keeps between steps, with this step's gradients: the
  // figure the ZeRO closed forms predict. Called right after the optimizer.
  // Resident bytes the allocator does not see (the resident set minus the
  // allocator's reserved bytes: the binary and libraries, threads, MPI's
  // buffers, oneDNN's generated kernels, the data loader's containers),
  // measured when training starts and after the first step, when the kernels
  // and buffers exist, printed with the peak RSS they predict beside
  // `predicted_reserved`, the estimate's peak of reserved bytes; measured
  // again at every logged step for the metrics (untracked_bytes).
  void measure_untracked(int64_t after_step, size_t predicted_reserved);
  void record_live_after_optimizer() { steady_live_ = TrackingAllocator::instance().stats().live; }
  // A mixture-of-experts model's step report (before step_done).
  void add_moe(const MoeReport& r);
  // A completed step; writes the log line when it is due.
  void step_done(int64_t step, double loss, double grad_norm, double lr, int64_t step_tokens);
  void log_validation(int64_t step, double loss, int64_t tokens);
  // "anvil: done: ..." for a run that was not interrupted.
  void print_done(const TrainResult& result) const;
  // The allocator's peaks over the whole run so far (every logging interval's
  // and the current one's): per category, of the total, and reserved.
  MemStats run_peaks() const;
  // A job on a GPU: its device pool's, likewise (empty on the CPU).
  MemStats device_run_peaks() const;
  Device device() const { return device_; }

 private:
  void write(int64_t step, double loss, double grad_norm, double lr);

  using Clock = std::chrono::steady_clock;
  const JobConfig& cfg_;
  const ParallelDims& par_;
  PeakFlops peak_;
  double flops_per_token_;
  double comm_closed_form_;
  double optimizer_flops_ = 0, optimizer_bytes_closed_form_ = 0;
  uint64_t interval_optimizer_bytes_ = 0;
  std::unique_ptr<MetricsLog> metrics_;
  std::unique_ptr<TensorBoardWriter> tb_;
  Clock::time_point t_start_, t_interval_;
  double data_seconds_ = 0;
  int64_t interval_tokens_ = 0;
  int64_t interval_logged_steps_ = 0;  // steps since the last log line
  MoeReport interval_moe_;  // routes summed over the interval, the last step's aux loss, the most rows received
  MemStats run_peaks_;  // the largest peaks of the logging intervals written so far
  Device device_;       // where the job runs: the default device when the logger is made
  MemStats device_run_peaks_;
  size_t untracked_ = 0;  // the latest measure_untracked
  bool mfu_warned_ = false;
  std::array<size_t, kNumMemCategories> steady_live_{};
  CommStats interval_comm_;  // this rank's data-parallel communication since the last log line
  int64_t interval_steps_ = 0;
  uint64_t interval_tp_bytes_ = 0;
  uint64_t interval_pp_bytes_ = 0;
  uint64_t interval_ep_bytes_ = 0;
};

}  // namespace anvil
