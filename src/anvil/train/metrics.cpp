#include "anvil/train/metrics.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <thread>

#include "anvil/core/error.h"
#include "anvil/estimate/memory.h"

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
  if (load.size() <= 64)
    for (const double l : load) out += kBars[std::clamp(static_cast<int>(l / 2.0 * 8.0), 0, 7)];
  char tail[96];
  std::snprintf(tail, sizeof tail, "%sload max %.2f (expert %lld) min %.2f (expert %lld)", out.empty() ? "" : " ",
                *hi, static_cast<long long>(hi - load.begin()), *lo, static_cast<long long>(lo - load.begin()));
  return out + tail;
}

void print_step_line(const StepLog& s) {
  auto cat = [&](MemCategory c) { return s.memory.peak[static_cast<int>(c)]; };
  std::printf(
      "step %5lld | loss %7.4f | grad_norm %7.3f | lr %.2e | %8.0f tok/s | %6.3f TFLOP/s | MFU %5.2f%% | "
      "mem %s (param %s, grad %s, opt %s, act %s, ws %s) | data %4.1f%% | %6.1fs",
      static_cast<long long>(s.step), s.loss, s.grad_norm, s.lr, s.tokens_per_s, s.tflops, s.mfu_pct,
      human_bytes(s.memory.peak_total).c_str(), human_bytes(cat(MemCategory::parameters)).c_str(),
      human_bytes(cat(MemCategory::gradients)).c_str(), human_bytes(cat(MemCategory::optimizer_state)).c_str(),
      human_bytes(cat(MemCategory::activations)).c_str(), human_bytes(cat(MemCategory::workspace)).c_str(),
      s.data_pct, s.elapsed_s);
  // Distributed: the figures above are rank 0's (tok/s and MFU per rank); the
  // memory that matters is the fullest rank's.
  if (s.world_size > 1)
    std::printf(" | %d ranks, max mem %s | comm %s/step, %.0f%% hidden", s.world_size,
                human_bytes(s.max_memory_over_ranks).c_str(), human_bytes(static_cast<size_t>(s.comm_bytes_per_step)).c_str(),
                s.comm_hidden_pct);
  if (s.ep_comm_bytes_per_step > 0)
    std::printf(", experts' all-to-all %s/step", human_bytes(static_cast<size_t>(s.ep_comm_bytes_per_step)).c_str());
  if (s.moe_experts > 0)
    std::printf(" | aux %.4f | experts %s", s.moe_aux_loss,
                expert_load_summary(expert_load(s.moe_routes, s.moe_experts)).c_str());
  std::printf("\n");
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
  if (s.moe_experts > 0) {
    j["moe_aux_loss"] = s.moe_aux_loss;
    j["moe_expert_load"] = expert_load(s.moe_routes, s.moe_experts);
    nlohmann::ordered_json layers = nlohmann::ordered_json::array();
    for (size_t i = 0; i < s.moe_routes.size(); i += static_cast<size_t>(s.moe_experts))
      layers.push_back(std::vector<double>(s.moe_routes.begin() + static_cast<std::ptrdiff_t>(i),
                                           s.moe_routes.begin() + static_cast<std::ptrdiff_t>(i + s.moe_experts)));
    j["moe_routes_by_layer"] = layers;
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
