#include "anvil/cli/plan_cmd.h"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <optional>

#include "anvil/cli/count_arg.h"
#include "anvil/core/durable_file.h"
#include "anvil/core/error.h"
#include "anvil/estimate/flops.h"
#include "anvil/estimate/gpu_estimate.h"
#include "anvil/estimate/gpu_hardware.h"
#include "anvil/estimate/gpu_search.h"
#include "anvil/estimate/gpu_seeds.h"
#include "anvil/train/console.h"

namespace anvil {

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

constexpr const char* kUsage =
    "usage: anvil plan CONFIG.toml [--section.key value ...] --hardware H --gpus N [--json] [--top K]\n"
    "                  [--calibration FILE] [--mean-document-tokens L]\n"
    "       anvil plan --seeds\n"
    "  Searches torchtitan-style layouts (FSDP/HSDP, CP, TP, PP degrees whose product is N, activation\n"
    "  checkpointing, local and micro-batch size) for the configuration's model and sequence length on N\n"
    "  GPUs, keeps those whose predicted per-GPU memory (torch's max reserved) fits, and ranks them by\n"
    "  predicted tokens/s per GPU (from measured kernel rates; docs/estimator.md): one row per layout (its\n"
    "  degrees and pipeline schedule) with its best batch, checkpointing and accumulation, each with its\n"
    "  step split into compute, exposed communication, pipeline bubble and overhead; then the fastest\n"
    "  layout under each pipeline schedule.\n"
    "  --hardware  h100-80g, a100-80g, a100-40g or h200\n"
    "  --gpus      how many GPUs\n"
    "  --top       rows to print (default 10)\n"
    "  --json      print the rows as JSON\n"
    "  --calibration  rates measured on your GPU (anvil calibrate --help) instead of the published ones\n"
    "  --mean-document-tokens  block-causal attention (model.attn_mask_type) over documents of L tokens on\n"
    "              average: attention's time scaled to the share of the causal pairs it computes (default:\n"
    "              documents no shorter than a sequence, the causal work)\n"
    "  --seeds     the predictions against seeds 000 and 001, as markdown tables with each row's error\n"
    "  The layouts are for GPU clusters, which Anvil plans but does not train on yet.\n\n"
    "examples:\n"
    "  anvil plan configs/llama3_8b.toml --hardware h100-80g --gpus 64\n"
    "  anvil plan configs/llama3_70b.toml --training.seq_len 8192 --hardware h200 --gpus 256 --top 5 --json\n";

// Said before any plan: the layouts are not ones `anvil train` runs.
constexpr const char* kGpuOnlyNote =
    "note: these layouts are for GPU clusters, which Anvil plans but does not train on yet (it trains on CPUs)\n";

// The model, sequence, batch and AC mode of the configuration; the layout is left at its defaults.
GpuRunSpec model_spec(const JobConfig& cfg, double mean_document_tokens) {
  ANVIL_CHECK(mean_document_tokens == 0 || cfg.model.attn_mask_type == "block_causal",
              "--mean-document-tokens ", mean_document_tokens, " models block-causal attention, but ",
              "model.attn_mask_type is \"", cfg.model.attn_mask_type, "\" (every token attends across documents)");
  ANVIL_CHECK(cfg.training.mixed_precision_param == "bfloat16", "training.mixed_precision_param = \"",
              cfg.training.mixed_precision_param, "\": the GPU planner models bf16 compute under FSDP2");
  GpuRunSpec s;
  s.model = job_model_args(cfg);
  s.seq_len = cfg.training.seq_len;
  s.local_batch = cfg.training.local_batch_size;
  s.ac = activation_checkpoint_policy(cfg);
  s.mean_document_tokens = mean_document_tokens;
  s.muon = cfg.optimizer.name == "Muon";
  s.muon_ns_steps = cfg.optimizer.muon_ns_steps;
  return s;
}

GpuRunSpec spec_from_config(const JobConfig& cfg, int64_t gpus, double mean_document_tokens) {
  GpuRunSpec s = model_spec(cfg, mean_document_tokens);
  const auto& p = cfg.parallelism;
  s.dp_replicate = p.data_parallel_replicate_degree;
  s.tp = p.tensor_parallel_degree;
  s.cp = p.context_parallel_degree;
  s.pp = p.pipeline_parallel_degree;
  s.ep = p.expert_parallel_degree;
  ANVIL_CHECK(gpus >= 1, "--gpus ", gpus, ": the planner needs at least one GPU");
  const int64_t others = s.dp_replicate * s.cp * s.tp * s.pp;
  ANVIL_CHECK(others >= 1 && gpus % others == 0, "--gpus ", gpus, " is not a multiple of data_parallel_replicate ",
              s.dp_replicate, " x context_parallel ", s.cp, " x tensor_parallel ", s.tp, " x pipeline_parallel ", s.pp);
  s.dp_shard = p.data_parallel_shard_degree == -1 ? gpus / others : p.data_parallel_shard_degree;
  ANVIL_CHECK(s.gpus() == gpus, "the layout's degrees multiply to ", s.gpus(), " GPUs, not --gpus ", gpus,
              " (parallelism.data_parallel_shard_degree -1 takes what the others leave)");
  const int64_t per_step = cfg.training.local_batch_size * s.dp_shard * s.dp_replicate;
  ANVIL_CHECK(cfg.training.global_batch_size == -1 || cfg.training.global_batch_size % per_step == 0,
              "training.global_batch_size ", cfg.training.global_batch_size,
              " is not a multiple of local_batch_size x data-parallel ranks = ", per_step);
  // Gradient accumulation: the global batch over the data-parallel ranks is
  // the local batch the step runs, in local_batch_size pieces.
  s.grad_accum = cfg.training.global_batch_size == -1 ? 1 : cfg.training.global_batch_size / per_step;
  s.local_batch = cfg.training.local_batch_size * s.grad_accum;
  s.cp_rotate = p.context_parallel_rotate_method;
  s.pp_schedule = p.pipeline_parallel_schedule;
  s.pp_schedule_csv = p.pipeline_parallel_schedule_csv;
  if (p.pipeline_parallel_layers_per_stage > 0) {
    const int64_t units = s.model.n_layers + 2;
    s.pp_stages_per_rank = units / p.pipeline_parallel_layers_per_stage / std::max<int64_t>(s.pp, 1);
  }
  s.microbatch_size = p.pipeline_parallel_microbatch_size;
  s.keep_pp_outputs = p.pipeline_parallel_keep_outputs;
  s.fsdp_single_rank = p.fsdp_single_rank;
  return s;
}

std::string gib(double bytes) {
  char b[32];
  std::snprintf(b, sizeof b, "%.2f", bytes / kGiB);
  return b;
}

nlohmann::json stage_json(const GpuStageMemory& m) {
  return {{"pp_stage", m.stage},
          {"layers", m.layers},
          {"in_flight_micro_batches", m.in_flight},
          {"peak_at", m.peak_at},
          {"reserved_bytes", m.reserved},
          {"peak_allocated_bytes", m.peak_allocated},
          {"by_category",
           {{"parameters", m.parameters},
            {"optimizer", m.optimizer},
            {"gradients", m.gradients},
            {"gradient_accumulators", m.grad_accumulators},
            {"gathered_parameters", m.gathered_params},
            {"activations", m.activations},
            {"working", m.working},
            {"loss_buffers", m.loss_buffers},
            {"kept_outputs", m.kept_outputs},
            {"merged_outputs", m.merged_outputs},
            {"pp_buffers", m.pp_buffers},
            {"allgather_pool", m.allgather_pool},
            {"reduce_scatter_input_pool", m.reduce_pool_extra}}}};
}

std::string layout_flags(const GpuRunSpec& s) {
  std::string f = "--parallelism.data_parallel_shard_degree " + std::to_string(s.dp_shard);
  if (s.dp_replicate > 1) f += " --parallelism.data_parallel_replicate_degree " + std::to_string(s.dp_replicate);
  if (s.ep > 1) f += " --parallelism.expert_parallel_degree " + std::to_string(s.ep);
  if (s.cp > 1)
    f += " --parallelism.context_parallel_degree " + std::to_string(s.cp) +
         " --parallelism.context_parallel_rotate_method " + s.cp_rotate;
  if (s.tp > 1) f += " --parallelism.tensor_parallel_degree " + std::to_string(s.tp);
  if (s.pp > 1) {
    f += " --parallelism.pipeline_parallel_degree " + std::to_string(s.pp) +
         " --parallelism.pipeline_parallel_schedule " + s.pp_schedule +
         " --parallelism.pipeline_parallel_microbatch_size " + std::to_string(s.microbatch_size);
  }
  switch (s.ac.mode) {
    case AcMode::none: f += " --activation_checkpoint.mode none"; break;
    case AcMode::full: f += " --activation_checkpoint.mode full"; break;
    case AcMode::selective_op:
      f += " --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op";
      break;
    case AcMode::selective_layer:
      f += " --activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option " +
           std::to_string(s.ac.every);
      break;
  }
  f += " --training.local_batch_size " + std::to_string(s.local_batch / s.grad_accum);
  if (s.grad_accum > 1)
    f += " --training.global_batch_size " + std::to_string(s.local_batch * s.dp_shard * s.dp_replicate);
  return f;
}

nlohmann::json plan_row_json(const GpuPlanRow& r) {
  const GpuStepEstimate& e = r.estimate;
  return nlohmann::json{{"tokens_per_second_per_gpu", e.tokens_per_second_per_gpu},
                        {"mfu", e.mfu},
                        {"step_seconds", e.step_seconds},
                        {"compute_seconds", e.compute_seconds},
                        {"exposed_comm_seconds", e.exposed_comm_seconds},
                        {"bubble_seconds", e.bubble_seconds},
                        {"overhead_seconds", e.overhead_seconds},
                        {"max_reserved_bytes", e.max_reserved},
                        {"global_batch", r.spec.local_batch * r.spec.dp_shard * r.spec.dp_replicate},
                        {"cp_comm_seconds", e.cp_comm_seconds},
                        {"pipeline_schedule", r.spec.pp > 1 ? r.spec.pp_schedule : ""},
                        {"flags", layout_flags(r.spec)}};
}

// The estimate's verdict on the GPUs: whether the configured layout fits
// their memory and, when it does not, the layouts of as many GPUs that do,
// fastest first, as `anvil plan` finds them (at most three).
struct GpuVerdict {
  bool fits = false;
  std::vector<GpuPlanRow> instead;

  std::string line(const GpuStepEstimate& e, const GpuHardware& hw, int64_t gpus) const {
    const std::string where = detail::concat(gpus, " x ", hw.name);
    const std::string memory =
        detail::concat("max reserved ", gib(e.max_reserved), " GiB of ", gib(hw.hbm_bytes), " GiB per GPU");
    if (fits) return "verdict: fits " + where + ": " + memory;
    std::string out = "verdict: does not fit " + where + ": " + memory + ". ";
    if (instead.empty())
      return out + "No layout of " + where + " fits: more GPUs, a shorter sequence or a smaller model";
    out += "What fits on " + where + ", fastest first (anvil plan):";
    for (size_t i = 0; i < instead.size(); ++i)
      out += detail::concat(i ? ";" : "", " ", i + 1, ") ", layout_flags(instead[i].spec), " (max reserved ",
                            gib(instead[i].estimate.max_reserved), " GiB, ",
                            with_commas(std::llround(instead[i].estimate.tokens_per_second_per_gpu)),
                            " tokens/s per GPU)");
    return out;
  }
};

GpuVerdict gpu_verdict(const GpuStepEstimate& e, const GpuRunSpec& base, const GpuHardware& hw, int64_t gpus,
                       const GpuCalibration* cal) {
  GpuVerdict v;
  v.fits = e.fits;
  if (v.fits) return v;
  v.instead = distinct_layouts(search_gpu_layouts(base, hw, gpus, cal).rows);
  if (v.instead.size() > 3) v.instead.resize(3);
  return v;
}

}  // namespace

int gpu_estimate_command(const JobConfig& cfg, const std::string& hardware, int64_t gpus, bool json,
                         const std::string& calibration, double mean_document_tokens) {
  const GpuHardware& hw = gpu_hardware(hardware);
  const GpuRunSpec spec = spec_from_config(cfg, gpus, mean_document_tokens);
  std::optional<GpuCalibration> cal;
  if (!calibration.empty()) cal = GpuCalibration::load(calibration);
  const GpuStepEstimate e = estimate_gpu_run(spec, hw, cal ? &*cal : nullptr);
  const GpuVerdict verdict = gpu_verdict(e, model_spec(cfg, mean_document_tokens), hw, gpus, cal ? &*cal : nullptr);
  if (json) {
    nlohmann::json j;
    j["hardware"] = hw.name;
    j["gpus"] = gpus;
    j["model"] = spec.model.name + "/" + spec.model.flavor;
    j["data_parallel"] = spec.autocast() ? "bf16 autocast, no FSDP" : "FSDP2";
    j["expert_parallel_degree"] = spec.ep;
    j["parameters_per_gpu"] = e.parameters_per_gpu;
    j["stages"] = nlohmann::json::array();
    for (const GpuStageMemory& m : e.stages) j["stages"].push_back(stage_json(m));
    j["max_reserved_bytes"] = e.max_reserved;
    j["fits"] = e.fits;
    j["attention_share_of_causal_pairs"] = block_causal_share(spec.seq_len, spec.mean_document_tokens);
    j["step_seconds"] = e.step_seconds;
    j["compute_seconds"] = e.compute_seconds;
    j["fsdp_comm_seconds"] = e.fsdp_comm_seconds;
    j["tp_comm_seconds"] = e.tp_comm_seconds;
    j["cp_comm_seconds"] = e.cp_comm_seconds;
    j["ep_comm_seconds"] = e.ep_comm_seconds;
    j["exposed_comm_seconds"] = e.exposed_comm_seconds;
    j["optimizer_seconds"] = e.optimizer_seconds;
    j["bubble_fraction"] = e.bubble_fraction;
    j["bubble_seconds"] = e.bubble_seconds;
    j["overhead_seconds"] = e.overhead_seconds;
    j["tokens_per_second_per_gpu"] = e.tokens_per_second_per_gpu;
    j["flops_per_token"] = e.flops_per_token;
    j["mfu"] = e.mfu;
    j["rates"] = e.rate_sources;
    j["parameters_stored_per_gpu"] = e.parameters_stored_per_gpu;
    j["hbm_bytes"] = hw.hbm_bytes;
    j["verdict"] = verdict.line(e, hw, gpus);
    j["fitting_layouts"] = nlohmann::json::array();  // when it does not fit: what does, fastest first
    for (const GpuPlanRow& r : verdict.instead) j["fitting_layouts"].push_back(plan_row_json(r));
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf("%s/%s on %lld x %s (%s): ", spec.model.name.c_str(), spec.model.flavor.c_str(),
              static_cast<long long>(gpus), hw.name.c_str(), hw.description.c_str());
  if (spec.autocast())
    std::printf("one GPU, bf16 autocast (torchtitan applies no FSDP at shard degree 1)");
  else
    std::printf("FSDP %lld%s", static_cast<long long>(spec.dp_shard),
                spec.fsdp_single_rank ? " (FSDP2 over one rank)" : "");
  if (spec.ep > 1) std::printf(" with expert parallel %lld", static_cast<long long>(spec.ep));
  if (spec.dp_replicate > 1) std::printf(" x replicate %lld", static_cast<long long>(spec.dp_replicate));
  if (spec.cp > 1) std::printf(" x CP %lld", static_cast<long long>(spec.cp));
  if (spec.tp > 1) std::printf(" x TP %lld", static_cast<long long>(spec.tp));
  if (spec.pp > 1)
    std::printf(" x PP %lld (%s, %lld micro-batches)", static_cast<long long>(spec.pp),
                spec.pp_schedule_csv.empty() ? spec.pp_schedule.c_str() : spec.pp_schedule_csv.c_str(),
                static_cast<long long>(spec.micro_batches()));
  if (spec.grad_accum > 1) std::printf(", %lld accumulation steps", static_cast<long long>(spec.grad_accum));
  std::printf(", AC %s, local batch %lld x seq %lld\n", ac_mode_name(spec.ac.mode),
              static_cast<long long>(spec.local_batch), static_cast<long long>(spec.seq_len));
  if (spec.mean_document_tokens > 0)
    std::printf("attention: block-causal over documents of %.0f tokens on average: %.1f%% of the causal pairs "
                "(its time scaled by that; FLOPs per token and MFU count the causal work, as torchtitan)\n\n",
                spec.mean_document_tokens, 100 * block_causal_share(spec.seq_len, spec.mean_document_tokens));
  else
    std::printf("attention: %s\n\n", cfg.model.attn_mask_type == "block_causal"
                                         ? "block-causal, timed as causal (documents no shorter than a sequence; "
                                           "--mean-document-tokens L for shorter ones)"
                                         : "causal");
  if (spec.model.moe())
    std::printf(
        "mixture of experts: %lld experts, %lld per token, %lld on each GPU; routing priced balanced (each "
        "expert the same share of the routes, as --debug.moe_force_load_balance or Anvil's "
        "model.moe_routing = \"balanced\" make it); the experts' products as torch._grouped_mm\n",
        static_cast<long long>(spec.model.num_experts), static_cast<long long>(spec.model.experts_per_token),
        static_cast<long long>(spec.model.num_experts / spec.ep));
  // What a GPU stores (its FSDP shard) is not what it computes with (its stage, gathered): both, named.
  std::printf("parameters: %s in the model", with_commas(spec.model.num_params()).c_str());
  if (spec.model.moe()) std::printf(" (%s active per token)", with_commas(spec.model.active_params()).c_str());
  std::printf(
      "; per GPU, %s stored (its FSDP shard) and %s gathered to compute (the largest pipeline stage's, "
      "after tensor and expert parallelism)\n",
      with_commas(std::llround(e.parameters_stored_per_gpu)).c_str(),
      with_commas(std::llround(e.parameters_per_gpu)).c_str());
  std::printf("per GPU, GiB       ");
  for (const GpuStageMemory& m : e.stages) std::printf(" | stage %-3d", m.stage);
  std::printf("\n");
  auto row = [&](const char* name, double GpuStageMemory::*f) {
    std::printf("%-19s", name);
    for (const GpuStageMemory& m : e.stages) std::printf(" | %9s", gib(m.*f).c_str());
    std::printf("\n");
  };
  row("parameters (fp32)", &GpuStageMemory::parameters);
  row(spec.muon ? "optimizer (Muon)" : "optimizer (AdamW)", &GpuStageMemory::optimizer);
  row("gradients (fp32)", &GpuStageMemory::gradients);
  row("grad accumulators", &GpuStageMemory::grad_accumulators);
  row("gathered (bf16)", &GpuStageMemory::gathered_params);
  row("activations", &GpuStageMemory::activations);
  row("working set", &GpuStageMemory::working);
  row("loss buffers", &GpuStageMemory::loss_buffers);
  row("kept outputs", &GpuStageMemory::kept_outputs);
  row("merged outputs", &GpuStageMemory::merged_outputs);
  row("pp buffers", &GpuStageMemory::pp_buffers);
  row("all-gather pool", &GpuStageMemory::allgather_pool);
  row("reduce-scatter pool", &GpuStageMemory::reduce_pool_extra);
  row("peak allocated", &GpuStageMemory::peak_allocated);
  row("max reserved", &GpuStageMemory::reserved);
  std::printf("%-19s", "peak at");
  for (const GpuStageMemory& m : e.stages) std::printf(" | %s", m.peak_at.c_str());
  std::printf("\n\nmemory: max reserved %s GiB of %s GiB (%s)\n", gib(e.max_reserved).c_str(),
              gib(hw.hbm_bytes).c_str(), e.fits ? "fits" : "does NOT fit");
  std::printf(
      "step: %.3f s = compute %.3f s + exposed communication %.3f s + pipeline bubble %.3f s (%.1f%%) + "
      "overhead %.3f s (optimizer %.3f s)\n"
      "communication: FSDP %.3f s, TP %.3f s, CP %.3f s, EP all-to-all %.3f s\n",
      e.step_seconds, e.compute_seconds, e.exposed_comm_seconds, e.bubble_seconds, 100 * e.bubble_fraction,
      e.overhead_seconds, e.optimizer_seconds, e.fsdp_comm_seconds, e.tp_comm_seconds, e.cp_comm_seconds,
      e.ep_comm_seconds);
  std::printf("tokens/s per GPU: %.0f   MFU: %.1f%% (%s FLOPs per token, %.0f TFLOP/s peak)\n",
              e.tokens_per_second_per_gpu, 100 * e.mfu, with_commas(std::llround(e.flops_per_token)).c_str(),
              hw.peak_bf16_flops / 1e12);
  std::printf("(from measured kernel rates and published link speeds, not peaks; docs/estimator.md)\n");
  std::printf("rates: %s\n", e.rate_sources.c_str());
  std::printf("%s\n", verdict.line(e, hw, gpus).c_str());
  return 0;
}

int calibrate_command(const std::vector<std::string>& args) {
  static constexpr const char* kCalibrateUsage =
      "usage: anvil calibrate CONFIG.toml [--section.key value ...] --hardware H --gpus N --shapes FILE\n"
      "  Writes to FILE (JSON) every matrix-product and attention shape the GPU planner prices for the\n"
      "  configuration's run on N GPUs of H. On the GPU, time them with\n"
      "    python3 bench/gpu/calibrate.py --shapes FILE --output calibration.json\n"
      "  and estimate with them: anvil estimate CONFIG.toml --hardware H --gpus N --calibration calibration.json\n"
      "  (anvil plan takes --calibration too). docs/estimator.md describes the file.\n\n"
      "example:\n"
      "  anvil calibrate configs/llama3_8b.toml --hardware h100-80g --gpus 8 --shapes shapes.json\n";
  std::string hardware, shapes;
  int64_t gpus = 0;
  std::vector<std::string> rest;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      std::printf("%s", kCalibrateUsage);
      return 0;
    }
    auto value = [&]() -> const std::string& {
      ANVIL_CHECK(i + 1 < args.size(), "anvil calibrate: ", a, " needs a value\n", kCalibrateUsage);
      return args[++i];
    };
    if (a == "--hardware") hardware = value();
    else if (a == "--gpus") gpus = parse_count_arg("anvil calibrate", a, value());
    else if (a == "--shapes") shapes = value();
    else rest.push_back(a);
  }
  ANVIL_CHECK(!hardware.empty() && gpus > 0 && !shapes.empty(),
              "anvil calibrate: --hardware, --gpus and --shapes are needed\n", kCalibrateUsage);
  const JobConfig cfg = parse_config(rest);
  const GpuRunSpec spec = spec_from_config(cfg, gpus, 0);  // the shapes are the causal ones
  PricedShapes priced;
  estimate_gpu_run(spec, gpu_hardware(hardware), nullptr, &priced);
  write_file_durably(shapes, priced.json());
  std::printf("anvil: %zu matrix-product and %zu attention shapes written to %s; time them on the GPU with\n"
              "  python3 bench/gpu/calibrate.py --shapes %s --output calibration.json\n",
              priced.gemms.size(), priced.attention.size(), shapes.c_str(), shapes.c_str());
  return 0;
}

int plan_command(const std::vector<std::string>& args) {
  std::string hardware;
  int64_t gpus = 0, top = 10;
  bool json = false, seeds = false;
  std::string calibration;
  double mean_document_tokens = 0;
  std::vector<std::string> rest;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      std::printf("%s", kUsage);
      return 0;
    }
    auto value = [&]() -> const std::string& {
      ANVIL_CHECK(i + 1 < args.size(), "anvil plan: ", a, " needs a value\n", kUsage);
      return args[++i];
    };
    if (a == "--mean-document-tokens") {
      mean_document_tokens = static_cast<double>(parse_count_arg("anvil plan", a, value()));
      continue;
    }
    if (a == "--hardware") hardware = value();
    else if (a == "--gpus") gpus = parse_count_arg("anvil plan", a, value());
    else if (a == "--top") top = parse_count_arg("anvil plan", a, value());
    else if (a == "--json") json = true;
    else if (a == "--seeds") seeds = true;
    else if (a == "--calibration") calibration = value();
    else rest.push_back(a);
  }
  if (seeds) {
    std::printf("%s", seed_tables_markdown().c_str());
    return 0;
  }
  ANVIL_CHECK(!hardware.empty() && gpus > 0, "anvil plan: --hardware and --gpus are needed\n", kUsage);
  const GpuHardware& hw = gpu_hardware(hardware);
  const JobConfig cfg = parse_config(rest);
  const GpuRunSpec base = model_spec(cfg, mean_document_tokens);

  std::optional<GpuCalibration> cal;
  if (!calibration.empty()) cal = GpuCalibration::load(calibration);
  const GpuPlanResult found = search_gpu_layouts(base, hw, gpus, cal ? &*cal : nullptr);
  std::vector<GpuPlanRow> rows = distinct_layouts(found.rows);
  const size_t distinct = rows.size();
  if (static_cast<int64_t>(rows.size()) > top) rows.resize(static_cast<size_t>(top));
  const std::vector<GpuPlanRow> by_schedule = fastest_per_schedule(found.rows);
  if (json) {
    nlohmann::json j = nlohmann::json::array();
    for (const GpuPlanRow& r : rows) j.push_back(plan_row_json(r));
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf("%s", kGpuOnlyNote);
  std::printf(
      "%s/%s, seq %lld, on %lld x %s: %s configurations tried, %s layouts fit in %s GiB; the "
      "fastest %zu by predicted tokens/s per GPU, each with its best batch, checkpointing and "
      "accumulation\n\n",
      base.model.name.c_str(), base.model.flavor.c_str(), static_cast<long long>(base.seq_len),
      static_cast<long long>(gpus), hw.name.c_str(), with_commas(found.tried).c_str(),
      with_commas(static_cast<int64_t>(distinct)).c_str(), gib(hw.hbm_bytes).c_str(), rows.size());
  auto table = [&](const std::vector<GpuPlanRow>& list) {
    std::printf(
        "| # | tokens/s/GPU | MFU | step (s) | compute | exposed comm | bubble | overhead | max reserved (GiB) "
        "| global batch | flags |\n|---|---|---|---|---|---|---|---|---|---|---|\n");
    int n = 0;
    for (const GpuPlanRow& r : list) {
      const GpuStepEstimate& e = r.estimate;
      std::printf("| %d | %.0f | %.1f%% | %.2f | %.2f | %.2f | %.2f | %.2f | %s | %lld | %s |\n", ++n,
                  e.tokens_per_second_per_gpu, 100 * e.mfu, e.step_seconds, e.compute_seconds, e.exposed_comm_seconds,
                  e.bubble_seconds, e.overhead_seconds, gib(e.max_reserved).c_str(),
                  static_cast<long long>(r.spec.local_batch * r.spec.dp_shard * r.spec.dp_replicate),
                  layout_flags(r.spec).c_str());
    }
  };
  table(rows);
  if (rows.empty()) std::printf("(no layout fits: more GPUs, a shorter sequence or a smaller model)\n");
  if (!by_schedule.empty()) {
    std::printf("\nThe fastest layout under each pipeline schedule:\n\n");
    table(by_schedule);
  }
  std::printf(
      "\n(step = compute + exposed communication + pipeline bubble + overhead, in seconds: measured kernel "
      "rates, not peaks; docs/estimator.md gives each constant's source and the error against published runs)\n");
  return 0;
}

}  // namespace anvil
