#include "anvil/train/step_logger.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <vector>

#include "anvil/core/device_pool.h"
#include "anvil/core/error.h"
#include "anvil/core/process_memory.h"
#include "anvil/train/trainer.h"

namespace anvil {

namespace {
double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// `so_far`'s peaks raised to `now`'s: the peaks over both.
MemStats max_peaks(MemStats so_far, const MemStats& now) {
  for (int c = 0; c < kNumMemCategories; ++c) so_far.peak[c] = std::max(so_far.peak[c], now.peak[c]);
  so_far.peak_total = std::max(so_far.peak_total, now.peak_total);
  so_far.peak_reserved = std::max(so_far.peak_reserved, now.peak_reserved);
  return so_far;
}
}  // namespace

StepLogger::StepLogger(const JobConfig& cfg, const ParallelDims& par, PeakFlops peak, double flops_per_token,
                       double comm_bytes_closed_form)
    : cfg_(cfg), par_(par), peak_(std::move(peak)), flops_per_token_(flops_per_token),
      comm_closed_form_(comm_bytes_closed_form), device_(default_device()) {
  if (par.rank0()) metrics_ = std::make_unique<MetricsLog>(cfg.job.dump_folder);
  if (cfg.metrics.enable_tensorboard && par.rank0())
    tb_ = std::make_unique<TensorBoardWriter>(
        (std::filesystem::path(cfg.job.dump_folder) / cfg.metrics.save_tb_folder).string());
}

void StepLogger::print_destinations() const {
  std::printf("anvil: outputs in %s: metrics %s", cfg_.job.dump_folder.c_str(),
              metrics_ ? metrics_->path().c_str() : "(rank 0)");
  if (tb_)
    std::printf(", TensorBoard %s", (std::filesystem::path(cfg_.job.dump_folder) / cfg_.metrics.save_tb_folder).c_str());
  std::printf("; a report of the run: anvil report %s\n", cfg_.job.dump_folder.c_str());
}

void StepLogger::measure_untracked(int64_t after_step, size_t predicted_reserved) {
  const size_t rss = resident_set_bytes(), reserved = TrackingAllocator::instance().stats().reserved;
  untracked_ = rss > reserved ? rss - reserved : 0;
  std::printf("anvil: %s: resident %s, %s of it outside the allocator (binary, libraries, threads, kernels); "
              "predicted peak RSS %s (the estimate's %s + that)\n",
              after_step > 0 ? detail::concat("after step ", after_step).c_str() : "training starts",
              human_bytes(rss).c_str(), human_bytes(untracked_).c_str(),
              human_bytes(predicted_reserved + untracked_).c_str(), human_bytes(predicted_reserved).c_str());
}

void gather_rank_figures(const ParallelDims& par, StepLog& log) {
  if (!par.distributed()) return;
  const std::vector<double> mib = par.gather_world(static_cast<double>(log.memory.peak_total) / (1 << 20));
  log.tokens_per_s_by_rank = par.gather_world(log.tokens_per_s);
  for (double m : mib) log.peak_mib_by_rank.push_back(m);
  // Activations apart: what a pipeline schedule keeps in flight shows there.
  log.activation_peak_mib_by_rank = par.gather_world(
      static_cast<double>(log.memory.peak[static_cast<int>(MemCategory::activations)]) / (1 << 20));
  log.peak_rss_mib_by_rank = par.gather_world(static_cast<double>(log.peak_rss) / (1 << 20));
  log.untracked_mib_by_rank = par.gather_world(static_cast<double>(log.untracked) / (1 << 20));
  log.peak_reserved_mib_by_rank = par.gather_world(static_cast<double>(log.memory.peak_reserved) / (1 << 20));
  if (log.moe_experts > 0) {  // the same on every rank
    log.moe_received_rows_by_rank = par.gather_world(static_cast<double>(log.moe_received_rows));
    log.moe_received_share_by_rank = par.gather_world(log.moe_received_share);
  }
  // Each category's peak on every rank: what the per-rank estimate is held against.
  const std::vector<double> mine(log.memory.peak.begin(), log.memory.peak.end());
  const std::vector<double> all = par.gather_world(mine);
  for (int r = 0; r < par.world_size; ++r) {
    std::array<double, kNumMemCategories> peaks{};
    for (int c = 0; c < kNumMemCategories; ++c)
      peaks[static_cast<size_t>(c)] = all[static_cast<size_t>(r * kNumMemCategories + c)];
    log.peak_by_rank_by_category.push_back(peaks);
  }
  log.max_memory_over_ranks = log.memory.peak_total;
  for (double m : mib)
    log.max_memory_over_ranks = std::max(log.max_memory_over_ranks, static_cast<size_t>(m * (1 << 20)));
}

MemStats StepLogger::run_peaks() const { return max_peaks(run_peaks_, TrackingAllocator::instance().stats()); }

MemStats StepLogger::device_run_peaks() const {
  if (device_.is_cpu()) return {};
  return max_peaks(device_run_peaks_, mem_stats(device_pool(device_).stats()));
}

void StepLogger::start() {
  TrackingAllocator::instance().reset_peak();
  if (!device_.is_cpu()) device_pool(device_).reset_peak();
  t_start_ = Clock::now();
  t_interval_ = Clock::now();
}

void StepLogger::add_comm(const StepComm& c) {
  interval_comm_.bytes += c.data_parallel.bytes;
  interval_comm_.in_flight_s += c.data_parallel.in_flight_s;
  interval_comm_.blocked_s += c.data_parallel.blocked_s;
  interval_comm_.collectives += c.data_parallel.collectives;
  ++interval_steps_;
  interval_tp_bytes_ += c.tp_bytes;
  interval_pp_bytes_ += c.pp_bytes;
  interval_ep_bytes_ += c.ep_bytes;
  interval_optimizer_bytes_ += c.optimizer_bytes;
}

void StepLogger::add_moe(const MoeReport& r) {
  if (r.num_experts == 0) return;
  if (interval_moe_.routes.size() != r.routes.size()) interval_moe_.routes.assign(r.routes.size(), 0.0);
  interval_moe_.num_experts = r.num_experts;
  for (size_t i = 0; i < r.routes.size(); ++i) interval_moe_.routes[i] += r.routes[i];
  interval_moe_.aux_loss = r.aux_loss;
  interval_moe_.received_rows = std::max(interval_moe_.received_rows, r.received_rows);
  interval_moe_.received_share = std::max(interval_moe_.received_share, r.received_share);
}

void StepLogger::step_done(int64_t step, double loss, double grad_norm, double lr, int64_t step_tokens) {
  interval_tokens_ += step_tokens;
  ++interval_logged_steps_;
  if (step % cfg_.metrics.log_freq == 0 || step == cfg_.training.steps) write(step, loss, grad_norm, lr);
}

void StepLogger::write(int64_t step, double loss, double grad_norm, double lr) {
  auto& alloc = TrackingAllocator::instance();
  const double secs = seconds_since(t_interval_);
  StepLog log;
  log.step = step;
  log.total_steps = cfg_.training.steps;
  // The remaining steps at this interval's pace (its validation and saves included).
  if (step < cfg_.training.steps)
    log.eta_s = secs / static_cast<double>(std::max<int64_t>(1, interval_logged_steps_)) *
                static_cast<double>(cfg_.training.steps - step);
  interval_logged_steps_ = 0;
  log.loss = loss;
  log.grad_norm = grad_norm;
  log.lr = lr;
  // Per rank, as torchtitan: the ranks of a tp group, and the stages of a
  // pipeline, share their tokens' work.
  log.tokens_per_s = static_cast<double>(interval_tokens_) / secs / (par_.tp_size * par_.pp_size);
  log.tflops = flops_per_token_ * log.tokens_per_s / 1e12;
  // A GPU without a known peak (gpu_peak_flops) has no MFU: 0, and the banner said why.
  log.mfu_pct = peak_.flops_per_s > 0 ? 100.0 * flops_per_token_ * log.tokens_per_s / peak_.flops_per_s : 0.0;
  // Never printed silently: above 100% either the peak is wrong for this
  // CPU or the FLOP count overstates the work (causal attention counted whole).
  if (log.mfu_pct > 100.0 && !mfu_warned_) {
    std::fprintf(stderr,
                 "anvil: warning: MFU %.0f%% is above 100%%: the peak (%s) is below what this run computes; "
                 "set metrics.peak_tflops to this machine's real peak\n",
                 log.mfu_pct, peak_.derivation.c_str());
    mfu_warned_ = true;
  }
  log.memory = alloc.stats();
  if (!device_.is_cpu()) {
    log.device = device_;
    log.device_memory = mem_stats(device_pool(device_).stats());
  }
  log.data_pct = 100.0 * data_seconds_ / secs;
  log.elapsed_s = seconds_since(t_start_);
  log.world_size = par_.world_size;
  log.peak_rss = peak_resident_set_bytes();
  {  // what the allocator does not see, now (it settles over the first steps)
    const size_t rss = resident_set_bytes(), reserved = alloc.stats().reserved;
    untracked_ = rss > reserved ? rss - reserved : 0;
  }
  log.untracked = untracked_;
  log.live_after_optimizer = steady_live_;
  log.moe_experts = interval_moe_.num_experts;
  log.moe_aux_loss = interval_moe_.aux_loss;
  log.moe_routes = interval_moe_.routes;
  log.moe_received_rows = interval_moe_.received_rows;
  log.moe_received_share = interval_moe_.received_share;
  interval_moe_ = {};
  if (par_.distributed() && interval_steps_ > 0) {
    const auto steps = static_cast<double>(interval_steps_);
    log.comm_bytes_per_step = static_cast<double>(interval_comm_.bytes) / steps;
    log.comm_in_flight_s = interval_comm_.in_flight_s / steps;
    log.comm_blocked_s = interval_comm_.blocked_s / steps;
    log.comm_hidden_pct = 100.0 * interval_comm_.hidden_share();
    log.comm_bytes_closed_form = comm_closed_form_;
    log.tp_comm_bytes_per_step = static_cast<double>(interval_tp_bytes_) / steps;
    log.pp_comm_bytes_per_step = static_cast<double>(interval_pp_bytes_) / steps;
    log.ep_comm_bytes_per_step = static_cast<double>(interval_ep_bytes_) / steps;
    log.optimizer_comm_bytes_per_step = static_cast<double>(interval_optimizer_bytes_) / steps;
    log.optimizer_comm_bytes_closed_form = optimizer_bytes_closed_form_;
  }
  log.optimizer_flops_per_step = optimizer_flops_;
  interval_comm_ = {};
  interval_steps_ = 0;
  interval_tp_bytes_ = 0;
  interval_pp_bytes_ = 0;
  interval_ep_bytes_ = 0;
  interval_optimizer_bytes_ = 0;
  gather_rank_figures(par_, log);
  print_step_line(log, cfg_.metrics.verbose);
  if (metrics_) metrics_->log(log);
  if (tb_) {
    tb_->add_scalar("loss/train", log.loss, step);
    tb_->add_scalar("grad_norm", log.grad_norm, step);
    tb_->add_scalar("lr", log.lr, step);
    if (log.moe_experts > 0) {
      const std::vector<double> load = expert_load(log.moe_routes, log.moe_experts);
      tb_->add_scalar("moe/aux_loss", log.moe_aux_loss, step);
      tb_->add_scalar("moe/max_expert_load", *std::max_element(load.begin(), load.end()), step);
      tb_->add_scalar("moe/min_expert_load", *std::min_element(load.begin(), load.end()), step);
    }
    tb_->add_scalar("throughput/tokens_per_s", log.tokens_per_s, step);
    tb_->add_scalar("throughput/tflops", log.tflops, step);
    tb_->add_scalar("throughput/mfu_pct", log.mfu_pct, step);
    tb_->add_scalar("throughput/data_loading_pct", log.data_pct, step);
    tb_->add_scalar("memory/max_active_bytes", static_cast<double>(log.memory.peak_total), step);
    for (int c = 0; c < kNumMemCategories; ++c)
      tb_->add_scalar(std::string("memory/") + category_name(static_cast<MemCategory>(c)),
                      static_cast<double>(log.memory.peak[c]), step);
    tb_->flush();
  }
  run_peaks_ = run_peaks();
  alloc.reset_peak();
  if (!device_.is_cpu()) {
    device_run_peaks_ = device_run_peaks();
    device_pool(device_).reset_peak();
  }
  t_interval_ = Clock::now();
  interval_tokens_ = 0;
  data_seconds_ = 0;
}

void StepLogger::log_validation(int64_t step, double loss, int64_t tokens) {
  std::printf("step %5lld | validation loss %.4f over %lld tokens\n", static_cast<long long>(step), loss,
              static_cast<long long>(tokens));
  if (metrics_) metrics_->log_validation(step, loss, tokens);
  if (tb_) {
    tb_->add_scalar("loss/validation", loss, step);
    tb_->flush();
  }
}

void StepLogger::print_done(const TrainResult& result) const {
  if (result.interrupted) return;
  // After a resume the loss runs from the checkpoint's own step, not from this run's first.
  const bool resumed = result.first_step > 1;
  const std::string steps =
      resumed ? detail::concat("steps ", result.first_step, "-", result.steps_done, " (resumed from step ",
                               result.first_step - 1, ")")
              : detail::concat(result.steps_done, " steps");
  char loss[128];
  if (resumed && !std::isnan(result.resumed_loss))
    std::snprintf(loss, sizeof loss, "loss %.4f (step %lld) -> %.4f (step %lld)", result.resumed_loss,
                  static_cast<long long>(result.first_step - 1), result.last_loss,
                  static_cast<long long>(result.steps_done));
  else if (resumed)
    std::snprintf(loss, sizeof loss, "loss %.4f (step %lld) -> %.4f (step %lld)", result.first_loss,
                  static_cast<long long>(result.first_step), result.last_loss,
                  static_cast<long long>(result.steps_done));
  else
    std::snprintf(loss, sizeof loss, "loss %.4f -> %.4f", result.first_loss, result.last_loss);
  const MemStats device_peaks = device_run_peaks();
  const std::string on_device =
      device_.is_cpu() ? std::string()
                       : detail::concat("; on ", device_.str(), " peak ", human_bytes(device_peaks.peak_total), " (",
                                        human_bytes(device_peaks.peak_reserved), " reserved)");
  std::printf("anvil: done: %s, %s in %s; peak RSS %s, peak tracked %s, untracked %s%s\n", steps.c_str(), loss,
              duration_text(seconds_since(t_start_)).c_str(), human_bytes(peak_resident_set_bytes()).c_str(),
              human_bytes(run_peaks().peak_total).c_str(), human_bytes(untracked_).c_str(), on_device.c_str());
}

}  // namespace anvil
