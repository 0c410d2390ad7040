#include "anvil/cli/estimate_cmd.h"

#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "anvil/cli/count_arg.h"
#include "anvil/cli/plan_cmd.h"
#include "anvil/core/error.h"
#include "anvil/estimate/gpu_hardware.h"
#include "anvil/train/config.h"
#include "anvil/train/console.h"
#include "anvil/train/gpu_job.h"
#include "anvil/train/preflight.h"

namespace anvil {

namespace {

constexpr const char* kUsage =
    "usage: anvil estimate [CONFIG.toml] [--section.key value ...] [--ranks N] [--json]\n"
    "       anvil estimate [CONFIG.toml] [--section.key value ...] --hardware H --gpus N [--json]\n"
    "                      [--calibration FILE] [--mean-document-tokens L]\n"
    "  Predicts a run without running it: every rank's peak memory per category under the configured layout,\n"
    "  FLOPs per token and communication per step. The last line is the verdict: whether the run fits this\n"
    "  machine's memory (all its ranks here, checked as anvil train checks before it starts) and, when it does\n"
    "  not, the changes that would fit.\n"
    "  --ranks N     the world size (default: the product of the degrees, data_parallel_shard_degree -1 as 1)\n"
    "  --json        the estimate as JSON, the verdict in its fits_this_machine and verdict fields\n"
    "  --job.device cuda\n"
    "                the dry run of the GPU path (one GPU; no GPU needed): the device memory per category and\n"
    "                reserved, as anvil train --job.device cuda allocates it, and whether it fits this machine's GPU\n"
    "  --hardware H --gpus N\n"
    "                the GPU-cluster planner instead: per-GPU memory, step time, tokens/s and MFU on N GPUs of H\n"
    "                (h100-80g, a100-80g, a100-40g or h200), and whether it fits their memory (the planner models\n"
    "                torchtitan-style PyTorch runs on GPU clusters)\n"
    "  --calibration FILE  the planner's rates measured on your GPU (anvil calibrate --help)\n"
    "  --mean-document-tokens L  the planner's block-causal attention over documents of L tokens\n\n"
    "examples:\n"
    "  anvil estimate configs/debugmodel.toml\n"
    "  anvil estimate configs/llama3_8b.toml --parallelism.data_parallel_shard_degree 8 --json\n"
    "  anvil estimate configs/llama3_8b.toml --hardware h100-80g --gpus 8\n"
    "  anvil estimate configs/llama3_1b.toml --job.device cuda --training.seq_len 8192\n\n";

}  // namespace

EstimateOptions parse_estimate_args(const std::vector<std::string>& args) {
  EstimateOptions o;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&]() -> const std::string& {
      ANVIL_CHECK(i + 1 < args.size(), "anvil estimate: ", a, " needs a value");
      return args[++i];
    };
    if (a == "--json") o.json = true;
    else if (a == "--ranks") o.ranks = static_cast<int>(parse_count_arg("anvil estimate", a, value()));
    else if (a == "--hardware") o.hardware = value();
    else if (a == "--gpus") o.gpus = parse_count_arg("anvil estimate", a, value());
    else if (a == "--calibration") o.calibration = value();
    else if (a == "--mean-document-tokens")
      o.mean_document_tokens = static_cast<double>(parse_count_arg("anvil estimate", a, value()));
    else o.config_args.push_back(a);
  }
  ANVIL_CHECK(o.hardware.empty() == (o.gpus == 0),
              "anvil estimate: --hardware and --gpus go together (the GPU planner: --hardware a100-80g --gpus 64)");
  ANVIL_CHECK(o.mean_document_tokens == 0 || !o.hardware.empty(),
              "anvil estimate: --mean-document-tokens is the GPU planner's: give --hardware and --gpus with it");
  ANVIL_CHECK(o.calibration.empty() || !o.hardware.empty(),
              "anvil estimate: --calibration is the GPU planner's: give --hardware and --gpus with it");
  ANVIL_CHECK(o.hardware.empty() || o.ranks == 0, "anvil estimate: --ranks is for Anvil's own ranks; with --hardware "
              "give --gpus");
  return o;
}

int implied_world_size(const JobConfig& cfg) {
  const auto& p = cfg.parallelism;
  return static_cast<int>(p.pipeline_parallel_degree * p.data_parallel_replicate_degree *
                          std::max<int64_t>(1, p.data_parallel_shard_degree) * p.context_parallel_degree *
                          p.tensor_parallel_degree);
}

nlohmann::ordered_json layout_estimate_json(const LayoutEstimate& est, const ModelArgs& args, int64_t seq_len) {
  nlohmann::ordered_json j;
  j["model"] = args.name + "/" + args.flavor;
  j["parameters"] = args.num_params();
  j["seq_len"] = seq_len;
  j["world_size"] = est.par.world_size;
  j["layout"] = est.par.description;
  j["accumulation_steps"] = est.par.accum_steps;
  j["pipeline_micro_batches"] = est.par.pp_micro_batches;
  nlohmann::ordered_json ranks = nlohmann::ordered_json::array();
  double dp = 0, pp = 0, tp = 0;
  for (const RankEstimate& r : est.ranks) {
    nlohmann::ordered_json rank;
    rank["rank"] = r.rank;
    rank["pp_rank"] = r.pp_rank;
    rank["pp_stage"] = r.stages.front();
    rank["pp_stages"] = r.stages;
    rank["peak_bytes"] = r.memory.peak_total;
    rank["peak_reserved_bytes"] = r.memory.peak_reserved;
    nlohmann::ordered_json cats;
    for (int c = 0; c < kNumMemCategories; ++c) cats[category_name(static_cast<MemCategory>(c))] = r.memory.peak[c];
    rank["by_category"] = cats;
    if (!r.device.is_cpu()) {  // the dry run of the GPU path: the device's figures (those above are the host's)
      nlohmann::ordered_json d;
      d["name"] = r.device.str();
      d["peak_bytes"] = r.device_memory.peak_total;
      d["peak_reserved_bytes"] = r.device_memory.peak_reserved;
      for (int c = 0; c < kNumMemCategories; ++c)
        d["by_category"][category_name(static_cast<MemCategory>(c))] = r.device_memory.peak[c];
      rank["device"] = d;
    }
    rank["comm_bytes_per_step"] = {{"data_parallel", r.data_parallel_bytes},
                                   {"tensor_parallel", r.tensor_parallel_bytes},
                                   {"pipeline", r.pipeline_bytes},
                                   {"expert_parallel", r.expert_parallel_bytes},
                                   {"optimizer", r.optimizer_bytes}};
    if (r.optimizer_flops > 0) rank["optimizer_flops_per_step"] = r.optimizer_flops;
    ranks.push_back(rank);
    dp = std::max(dp, r.data_parallel_bytes);
    pp = std::max(pp, r.pipeline_bytes);
    tp = std::max(tp, r.tensor_parallel_bytes);
  }
  j["ranks"] = ranks;
  j["flops_per_token"] = est.flops_per_token;
  j["comm_bytes_per_step"] = {{"data_parallel", dp},
                              {"tensor_parallel", tp},
                              {"pipeline", pp},
                              {"note", "the largest of any rank's; pipeline: sent and received"}};
  return j;
}

namespace {

// "0-63", "0, 2", "1, 3, 5-7": the world ranks of a role.
std::string rank_list(const LayoutEstimate& est, const RankEstimate& role) {
  std::vector<int> ranks;
  for (const RankEstimate& r : est.ranks)
    if (r.pp_rank == role.pp_rank && r.memory.peak == role.memory.peak) ranks.push_back(r.rank);
  std::string out;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    if (!out.empty()) out += ", ";
    out += std::to_string(ranks[i]);
    if (j > i) out.append("-").append(std::to_string(ranks[j]));
    i = j + 1;
  }
  return out;
}

void print_table(const LayoutEstimate& est, const ModelArgs& args, const JobConfig& cfg) {
  std::printf("%s/%s: %s parameters, %s FLOPs per token at seq_len %lld\n", args.name.c_str(), args.flavor.c_str(),
              with_commas(args.num_params()).c_str(), with_commas(std::llround(est.flops_per_token)).c_str(),
              static_cast<long long>(cfg.training.seq_len));
  std::printf("layout: %s; %lld micro-batch(es) per step\n", est.par.description.c_str(),
              static_cast<long long>(est.par.accum_steps));
  if (args.moe() && est.par.ep_size > 1)
    std::printf("mixture of experts: %lld experts, %lld per token, split over %d expert-parallel ranks; the dry run "
                "has every rank's experts receive %.2f times the balanced share of the routed tokens "
                "(model.moe_estimate_load); a learned routing's busiest rank sets the real memory\n",
                static_cast<long long>(args.num_experts), static_cast<long long>(args.experts_per_token),
                est.par.ep_size, cfg.model.moe_estimate_load);
  else if (args.moe())
    std::printf("mixture of experts: %lld experts, %lld per token; the dry run takes balanced routing (each "
                "expert M·k/E of a micro-batch's M·k routes); without expert parallelism the layer's memory does "
                "not depend on the routing, so this holds for learned routing too\n",
                static_cast<long long>(args.num_experts), static_cast<long long>(args.experts_per_token));
  // One column per distinct role: each pipeline rank, and rank 0 when it differs.
  std::vector<const RankEstimate*> roles;
  for (const RankEstimate& r : est.ranks)
    if (std::none_of(roles.begin(), roles.end(), [&](const RankEstimate* o) {
          return o->pp_rank == r.pp_rank && o->memory.peak == r.memory.peak;
        }))
      roles.push_back(&r);
  std::printf("predicted peak memory per rank:\n  %-16s", "");
  for (const RankEstimate* r : roles) {
    std::string head = "ranks ";
    head += rank_list(est, *r);
    if (est.par.pp_size > 1) {
      head += " (stage";
      for (size_t i = 0; i < r->stages.size(); ++i) head.append(i ? ", " : " ").append(std::to_string(r->stages[i]));
      head += ")";
    }
    std::printf(" %22s", head.c_str());
  }
  std::printf("\n");
  for (int c = 0; c < kNumMemCategories; ++c) {
    std::printf("  %-16s", category_name(static_cast<MemCategory>(c)));
    for (const RankEstimate* r : roles) std::printf(" %22s", human_bytes(r->memory.peak[c]).c_str());
    std::printf("\n");
  }
  std::printf("  %-16s", "peak total");
  for (const RankEstimate* r : roles) std::printf(" %22s", human_bytes(r->memory.peak_total).c_str());
  std::printf("\n  %-16s", "with the cache");  // the allocator's cached blocks: what the process holds
  for (const RankEstimate* r : roles) std::printf(" %22s", human_bytes(r->memory.peak_reserved).c_str());
  std::printf("\n");
  double dp = 0, pp = 0, tp = 0, ep = 0, opt = 0, opt_flops = 0;
  for (const RankEstimate& r : est.ranks)
    dp = std::max(dp, r.data_parallel_bytes), pp = std::max(pp, r.pipeline_bytes),
    tp = std::max(tp, r.tensor_parallel_bytes), ep = std::max(ep, r.expert_parallel_bytes),
    opt = std::max(opt, r.optimizer_bytes), opt_flops = std::max(opt_flops, r.optimizer_flops);
  if (dp > 0 || pp > 0 || tp > 0 || ep > 0)
    std::printf(
        "communication per rank per step: data parallel %s, tensor parallel %s, pipeline %s%s (sent and "
        "received)\n",
        human_bytes(static_cast<size_t>(dp)).c_str(), human_bytes(static_cast<size_t>(tp)).c_str(),
        human_bytes(static_cast<size_t>(pp)).c_str(),
        ep > 0 ? (", experts' all-to-all " + human_bytes(static_cast<size_t>(ep))).c_str() : "");
  if (opt_flops > 0) {
    std::printf("Muon's Newton-Schulz: %.3g GFLOP per step on the busiest rank", opt_flops / 1e9);
    if (opt > 0)
      std::printf("; its gathers and scatters send %s per rank per step", human_bytes(static_cast<size_t>(opt)).c_str());
    std::printf("\n");
  }
}

// The dry run of the GPU path: the device's peaks, and the host's beside them.
void print_device_table(const LayoutEstimate& est, const ModelArgs& args, const JobConfig& cfg) {
  const RankEstimate& r = est.ranks.front();
  std::printf("%s/%s: %s parameters, %s FLOPs per token at seq_len %lld\n", args.name.c_str(), args.flavor.c_str(),
              with_commas(args.num_params()).c_str(), with_commas(std::llround(est.flops_per_token)).c_str(),
              static_cast<long long>(cfg.training.seq_len));
  std::printf("on %s, one process; %lld micro-batch(es) per step\n", r.device.str().c_str(),
              static_cast<long long>(est.par.accum_steps));
  std::printf("predicted peak memory (the dry run of the GPU path over the device pool):\n  %-16s %16s %16s\n", "",
              r.device.str().c_str(), "host");
  for (int c = 0; c < kNumMemCategories; ++c)
    std::printf("  %-16s %16s %16s\n", category_name(static_cast<MemCategory>(c)),
                human_bytes(r.device_memory.peak[c]).c_str(), human_bytes(r.memory.peak[c]).c_str());
  std::printf("  %-16s %16s %16s\n", "peak total", human_bytes(r.device_memory.peak_total).c_str(),
              human_bytes(r.memory.peak_total).c_str());
  std::printf("  %-16s %16s %16s\n", "reserved", human_bytes(r.device_memory.peak_reserved).c_str(),
              human_bytes(r.memory.peak_reserved).c_str());
}

// Whether a job on one GPU fits: this machine's GPU where it has one, else
// the GPUs the planner knows, by the dry run's reserved peak.
std::string gpu_verdict(const JobConfig& cfg, const ModelArgs& model, const RankEstimate& r) {
  const size_t need = r.device_memory.peak_reserved;
  if (visible_gpus(nullptr) > 0) {
    const Device here = Device::cuda(0);
    const DeviceProperties gpu = device_runtime(here).properties(here.index);
    const std::string refusal = gpu_fit_refusal(cfg, model, r, gpu);
    if (!refusal.empty()) return "verdict: does not fit this machine's GPU: " + refusal;
    return detail::concat("verdict: fits this machine's GPU: it reserves ", human_bytes(need), " of the ",
                          human_bytes(gpu.memory_bytes), " of its ", gpu.name);
  }
  std::string fits;
  for (const std::string& name : known_gpu_hardware()) {
    const GpuHardware& hw = gpu_hardware(name);
    fits += detail::concat(fits.empty() ? "" : ", ", name, static_cast<double>(need) <= hw.hbm_bytes ? " yes" : " no");
  }
  return detail::concat("verdict: this machine has no GPU; the job reserves ", human_bytes(need),
                        " on one; fits (by memory): ", fits);
}

// Whether the run fits this machine, judged as `anvil train` judges it
// before it starts (train/preflight.h), with every rank of the job on this
// machine, as `mpirun -np N` here starts them: the fullest rank's peak
// against the memory available to each.
struct MachineVerdict {
  size_t available = 0;  // 0: unknown
  int ranks = 1;
  const RankEstimate* fullest = nullptr;
  std::string refusal;  // anvil train's, with the changes that would fit; "" when it fits
  bool known() const { return available > 0; }
  bool fits() const { return refusal.empty(); }

  std::string line() const {
    if (!known()) return "verdict: unknown: this machine's available memory could not be read (/proc/meminfo)";
    if (!fits()) return "verdict: does not fit this machine: " + refusal;
    return detail::concat("verdict: fits this machine: the fullest rank (rank ", fullest->rank, ") needs ",
                          human_bytes(fullest->memory.peak_reserved), " of the ", human_bytes(available / ranks),
                          ranks > 1 ? detail::concat(" each of the ", ranks, " ranks has (", human_bytes(available),
                                                     " available on this machine)")
                                    : std::string(" available on this machine"));
  }
};

MachineVerdict machine_verdict(const JobConfig& cfg, const ModelArgs& model, const LayoutEstimate& est) {
  MachineVerdict v;
  v.available = available_memory_bytes();
  v.ranks = est.par.world_size;
  v.fullest = &est.ranks.front();
  for (const RankEstimate& r : est.ranks)
    if (r.memory.peak_reserved > v.fullest->memory.peak_reserved) v.fullest = &r;
  v.refusal = fit_refusal(cfg, model, est.par, *v.fullest, v.available, v.ranks);
  return v;
}

}  // namespace

int estimate_command(const std::vector<std::string>& args) {
  for (const std::string& a : args)
    if (a == "--help" || a == "-h") {
      std::printf("%s%s", kUsage, config_help().c_str());
      return 0;
    }
  const EstimateOptions o = parse_estimate_args(args);
  const JobConfig cfg = parse_config(o.config_args);
  if (!o.hardware.empty())
    return gpu_estimate_command(cfg, o.hardware, o.gpus, o.json, o.calibration, o.mean_document_tokens);
  const ModelArgs model = job_model_args(cfg);
  const int ranks = o.ranks > 0 ? o.ranks : implied_world_size(cfg);
  // job.device cuda is estimated without a GPU (the dry run needs none); auto
  // takes the GPU where this machine has one.
  const Device device = cfg.job.device == "cuda" ? Device::cuda(0) : job_device(cfg);
  const LayoutEstimate est = estimate_layout(cfg, model, ranks, device);
  if (!device.is_cpu()) {
    const std::string verdict = gpu_verdict(cfg, model, est.ranks.front());
    if (o.json) {
      nlohmann::ordered_json j = layout_estimate_json(est, model, cfg.training.seq_len);
      j["verdict"] = verdict;
      std::printf("%s\n", j.dump(2).c_str());
    } else {
      print_device_table(est, model, cfg);
      std::printf("%s\n", verdict.c_str());
    }
    return 0;
  }
  const MachineVerdict verdict = machine_verdict(cfg, model, est);
  if (o.json) {
    nlohmann::ordered_json j = layout_estimate_json(est, model, cfg.training.seq_len);
    j["available_bytes"] = verdict.available;
    j["ranks_on_this_machine"] = verdict.ranks;
    j["fits_this_machine"] = verdict.known() ? nlohmann::ordered_json(verdict.fits()) : nlohmann::ordered_json();
    j["verdict"] = verdict.line();
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    print_table(est, model, cfg);
    std::printf("%s\n", verdict.line().c_str());
  }
  return 0;
}

}  // namespace anvil
