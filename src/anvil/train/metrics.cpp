#include "anvil/train/metrics.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <thread>

#include "anvil/core/error.h"
#include "anvil/estimate/memory.h"
#include "anvil/train/console.h"

namespace anvil {

MetricsLog::MetricsLog(const std::string& dump_folder) {
  std::error_code ec;
  std::filesystem::create_directories(dump_folder, ec);
  ANVIL_CHECK(!ec, "cannot create job.dump_folder '", dump_folder, "': ", ec.message());
  path_ = (std::filesystem::path(dump_folder) / "metrics.jsonl").string();
  jsonl_.open(path_, std::ios::app);
  ANVIL_CHECK(jsonl_.good(), "cannot write '", path_, "'");
}

namespace {
nlohmann::ordered_json by_category(const std::array<size_t, kNumMemCategories>& bytes) {
  nlohmann::ordered_json j;
  for (int c = 0; c < kNumMemCategories; ++c) j[category_name(static_cast<MemCategory>(c))] = bytes[static_cast<size_t>(c)];
  return j;
}
}  // namespace

std::vector<double> expert_load(const std::vector<double>& routes, int64_t num_experts) {
  std::vector<double> load(static_cast<size_t>(num_experts), 0.0);
  double total = 0;
  for (size_t i = 0; i < routes.size(); ++i) load[i % load.size()] += routes[i], total += routes[i];
  for (double& l : load) l = total > 0 ? l * static_cast<double>(num_experts) / total : 0.0;
  return load;
}

std::string expert_load_summary(const std::vector<double>& load) {
  if (load.empty()) return "";
  static const char* const kBars[] = {"▁", "▂", "▃", "▄", "▅", "▆", "▇", "█"};
  const auto [lo, hi] = std::minmax_element(load.begin(), load.end());
  std::string out;
  // A fixed scale, so bars compare across lines: 0 the lowest, twice the mean and above the highest.
  if (load.size() <= 48)
    for (const double l : load) out += kBars[std::clamp(static_cast<int>(l / 2.0 * 8.0), 0, 7)];
  char tail[96];
  std::snprintf(tail, sizeof tail, "%sload max %.2f (expert %lld) min %.2f (expert %lld)", out.empty() ? "" : " ",
                *hi, static_cast<long long>(hi - load.begin()), *lo, static_cast<long long>(lo - load.begin()));
  return out + tail;
}

std::string duration_text(double seconds) {
  const auto t = static_cast<long long>(seconds + 0.5);
  char buf[32];
  if (t < 60) std::snprintf(buf, sizeof buf, "%llds", t);
  else if (t < 3600) std::snprintf(buf, sizeof buf, "%lldm%02llds", t / 60, t % 60);
  else if (t < 86400) std::snprintf(buf, sizeof buf, "%lldh%02lldm", t / 3600, t % 3600 / 60);
  else std::snprintf(buf, sizeof buf, "%lldd%02lldh", t / 86400, t % 86400 / 3600);
  return buf;
}

std::string step_line(const StepLog& s, bool verbose) {
  // A job on a GPU shows the device's memory: the one that runs out.
  const bool gpu = !s.device.is_cpu();
  const MemStats& mem = gpu ? s.device_memory : s.memory;
  auto cat = [&](MemCategory c) { return human_bytes(mem.peak[static_cast<int>(c)]); };
  std::string line = detail::concat("step ", s.step, "/", s.total_steps);
  char buf[256];
  std::snprintf(buf, sizeof buf, " | loss %.4f | grad_norm %.3f | lr %.1e | %s tok/s | MFU %.1f%%", s.loss,
                s.grad_norm, s.lr, with_commas(static_cast<int64_t>(s.tokens_per_s + 0.5)).c_str(), s.mfu_pct);
  line += buf;
  // Distributed: tok/s and MFU are rank 0's (per rank); the memory shown is the
  // fullest rank's, the one that runs out first (the banner says so).
  line += " | mem " + human_bytes(s.world_size > 1 ? s.max_memory_over_ranks : mem.peak_total);
  if (gpu) line += " on " + s.device.str();
  if (verbose) {
    std::snprintf(buf, sizeof buf, " | %.3f TFLOP/s | data loading %.1f%% of the time | %.1f s elapsed", s.tflops,
                  s.data_pct, s.elapsed_s);
    line += " (param " + cat(MemCategory::parameters) + ", grad " + cat(MemCategory::gradients) + ", opt " +
            cat(MemCategory::optimizer_state) + ", act " + cat(MemCategory::activations) + ", ws " +
            cat(MemCategory::workspace) + ")" + buf;
    if (s.world_size > 1)
      line += detail::concat(" | ", s.world_size, " ranks, rank 0 mem ", human_bytes(s.memory.peak_total), " | comm ",
                             human_bytes(static_cast<size_t>(s.comm_bytes_per_step)), "/step, ",
                             static_cast<int>(s.comm_hidden_pct + 0.5), "% hidden");
    if (s.ep_comm_bytes_per_step > 0)
      line += ", experts' all-to-all " + human_bytes(static_cast<size_t>(s.ep_comm_bytes_per_step)) + "/step";
  }
  if (s.eta_s >= 0) line += ", ETA " + duration_text(s.eta_s);
  if (s.moe_experts > 0) {
    std::snprintf(buf, sizeof buf, "%saux %.4f | experts ", verbose ? " | " : "\n    ", s.moe_aux_loss);
    line += buf + expert_load_summary(expert_load(s.moe_routes, s.moe_experts));
  }
  return line;
}

void print_step_line(const StepLog& s, bool verbose) {
  std::printf("%s\n", step_line(s, verbose).c_str());
  std::fflush(stdout);
}

void MetricsLog::log(const StepLog& s) {
  const auto& peak = s.memory.peak;
  nlohmann::ordered_json j;
  j["step"] = s.step;
  j["loss"] = s.loss;
  j["grad_norm"] = s.grad_norm;
  j["lr"] = s.lr;
  j["tokens_per_s"] = s.tokens_per_s;
  j["tflops"] = s.tflops;
  j["mfu_pct"] = s.mfu_pct;
  j["max_active_bytes"] = s.memory.peak_total;
  j["max_active_bytes_by_category"] = by_category(peak);
  j["max_reserved_bytes"] = s.memory.peak_reserved;
  j["live_bytes_after_optimizer_by_category"] = by_category(s.live_after_optimizer);
  j["peak_rss_bytes"] = s.peak_rss;
  j["untracked_bytes"] = s.untracked;
  j["data_loading_pct"] = s.data_pct;
  j["elapsed_s"] = s.elapsed_s;
  if (s.optimizer_flops_per_step > 0) j["optimizer_flops_per_step"] = s.optimizer_flops_per_step;
  if (!s.device.is_cpu())  // the figures above are then the host's
    j["device"] = {{"name", s.device.str()},
                   {"max_active_bytes", s.device_memory.peak_total},
                   {"max_active_bytes_by_category", by_category(s.device_memory.peak)},
                   {"max_reserved_bytes", s.device_memory.peak_reserved}};
  if (s.moe_experts > 0) {
    j["moe_aux_loss"] = s.moe_aux_loss;
    j["moe_expert_load"] = expert_load(s.moe_routes, s.moe_experts);
    nlohmann::ordered_json layers = nlohmann::ordered_json::array();
    for (size_t i = 0; i < s.moe_routes.size(); i += static_cast<size_t>(s.moe_experts))
      layers.push_back(std::vector<double>(s.moe_routes.begin() + static_cast<std::ptrdiff_t>(i),
                                           s.moe_routes.begin() + static_cast<std::ptrdiff_t>(i + s.moe_experts)));
    j["moe_routes_by_layer"] = layers;
    j["moe_received_rows"] = s.moe_received_rows;
    j["moe_received_share"] = s.moe_received_share;
    if (s.world_size > 1) {
      j["moe_received_rows_by_rank"] = s.moe_received_rows_by_rank;
      j["moe_received_share_by_rank"] = s.moe_received_share_by_rank;
    }
  }
  if (s.world_size > 1) {
    j["world_size"] = s.world_size;
    j["max_active_bytes_max_over_ranks"] = s.max_memory_over_ranks;
    j["tokens_per_s_by_rank"] = s.tokens_per_s_by_rank;
    j["peak_mib_by_rank"] = s.peak_mib_by_rank;
    j["activation_peak_mib_by_rank"] = s.activation_peak_mib_by_rank;
    j["peak_rss_mib_by_rank"] = s.peak_rss_mib_by_rank;
    j["untracked_mib_by_rank"] = s.untracked_mib_by_rank;
    j["peak_reserved_mib_by_rank"] = s.peak_reserved_mib_by_rank;
    nlohmann::ordered_json by_rank = nlohmann::ordered_json::array();
    for (const auto& peaks : s.peak_by_rank_by_category) {
      nlohmann::ordered_json r;
      for (int c = 0; c < kNumMemCategories; ++c)
        r[category_name(static_cast<MemCategory>(c))] = static_cast<uint64_t>(peaks[static_cast<size_t>(c)]);
      by_rank.push_back(r);
    }
    j["max_active_bytes_by_rank_by_category"] = by_rank;
    j["comm_bytes_per_step"] = s.comm_bytes_per_step;
    j["comm_bytes_closed_form"] = s.comm_bytes_closed_form;
    j["tp_comm_bytes_per_step"] = s.tp_comm_bytes_per_step;
    j["pp_comm_bytes_per_step"] = s.pp_comm_bytes_per_step;
    j["ep_comm_bytes_per_step"] = s.ep_comm_bytes_per_step;
    j["optimizer_comm_bytes_per_step"] = s.optimizer_comm_bytes_per_step;
    j["optimizer_comm_bytes_closed_form"] = s.optimizer_comm_bytes_closed_form;
    j["comm_in_flight_s_per_step"] = s.comm_in_flight_s;
    j["comm_blocked_s_per_step"] = s.comm_blocked_s;
    j["comm_hidden_pct"] = s.comm_hidden_pct;
  }
  jsonl_ << j.dump() << "\n";
  jsonl_.flush();
}

void MetricsLog::log_validation(int64_t step, double loss, int64_t tokens) {
  nlohmann::ordered_json j;
  j["step"] = step;
  j["validation_loss"] = loss;
  j["validation_tokens"] = tokens;
  jsonl_ << j.dump() << "\n";
  jsonl_.flush();
}

}  // namespace anvil
