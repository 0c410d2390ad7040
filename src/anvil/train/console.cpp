#include "anvil/train/console.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "anvil/core/error.h"
#include "anvil/core/parallel_for.h"
#include "anvil/distributed/deadline.h"
#include "anvil/estimate/flops.h"
#include "anvil/estimate/memory.h"
#include "anvil/train/gpu_job.h"
#include "anvil/train/preflight.h"

namespace anvil {

void route_rank_output(const JobConfig& cfg, const ParallelDims& par) {
  if (!par.distributed()) return;
  const std::filesystem::path dir = std::filesystem::path(cfg.job.dump_folder) / "logs";
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  const std::string path = (dir / ("rank-" + std::to_string(par.rank) + ".log")).string();
  // The lines that say how a rank ended go there too (rank 0's file holds only
  // them): a rank cut off from the launcher is heard nowhere else.
  if (!ec) set_rank_log(path);
  if (par.rank0()) return;
  if (ec || std::freopen(path.c_str(), "a", stdout) == nullptr) {
    std::fprintf(stderr, "anvil: rank %d: cannot write %s (%s); this rank's log is discarded\n", par.rank,
                 path.c_str(), ec ? ec.message().c_str() : "cannot open it");
    (void)std::freopen("/dev/null", "w", stdout);
  }
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // a line at a time, so a killed rank's log is complete
}

std::string with_commas(int64_t n) {
  const std::string digits = std::to_string(n);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

namespace {

// A job on a GPU: its dry run of the GPU path against the GPU's memory,
// refused here when it does not fit.
RankEstimate check_gpu_fits(const JobConfig& cfg, const ModelArgs& args, Device device, const DeviceProperties& gpu) {
  const RankEstimate mine = dry_run_rank(cfg, args, 1, 0, nullptr, device);
  const std::string refusal = gpu_fit_refusal(cfg, args, mine, gpu);
  if (!refusal.empty()) throw Error(refusal);
  return mine;
}

}  // namespace

RunBasis check_fit_and_print_banner(const JobConfig& cfg, const ModelArgs& args, const ParallelDims& par, DType dt,
                                    const AcPolicy& ac, Device device) {
  const auto& tc = cfg.training;
  const bool gpu = !device.is_cpu();
  // This rank's own estimate under the layout (on a GPU, the dry run of the
  // GPU path), refused here when it does not fit.
  const DeviceProperties props = gpu ? device_runtime(device).properties(device.index) : DeviceProperties{};
  const size_t available = gpu ? props.memory_bytes : available_memory_bytes();
  const RankEstimate mine =
      gpu ? check_gpu_fits(cfg, args, device, props) : check_rank_fits(cfg, args, par, available, ranks_on_this_machine());
  const MemoryEstimate& est = gpu ? mine.device_memory : mine.memory;

  RunBasis mfu{cfg.metrics.peak_tflops > 0 ? PeakFlops{cfg.metrics.peak_tflops * 1e12, "metrics.peak_tflops (configured)"}
               : gpu                       ? gpu_peak_flops(props.name)
                                           : cpu_peak_flops(dt, num_threads()),
               flops_per_token(args, tc.seq_len),
               mine.memory.peak_reserved};  // the host's: what the resident set is held to
  if (!cfg.job.description.empty()) std::printf("anvil: %s\n", cfg.job.description.c_str());
  // A mixture of experts: its experts and routing in place of the dense width, and the parameters a token uses.
  const std::string ffn =
      args.moe()
          ? detail::concat(args.num_experts, " experts of width ", args.moe_ffn_hidden, ", ", args.experts_per_token,
                           " per token (", args.moe_balanced_routing ? "forced balanced" : "learned", " routing",
                           args.moe_sigmoid_scores ? " on sigmoid scores" : "", ", load-balancing loss x ",
                           args.router_aux_loss_coef,
                           args.moe_bias_update_rate > 0
                               ? detail::concat(", expert biases moving ", args.moe_bias_update_rate, " a step")
                               : std::string(),
                           ")")
          : detail::concat("ffn ", args.ffn_hidden_dim());
  const std::string active =
      args.moe() ? detail::concat(", ", with_commas(args.active_params()), " active per token") : std::string();
  std::printf("anvil: %s/%s, %s parameters%s (%lld layers, dim %lld, %lld heads, %lld kv heads, head_dim %lld%s, %s, "
              "vocab %lld)\n",
              args.name.c_str(), args.flavor.c_str(), with_commas(args.num_params()).c_str(), active.c_str(),
              static_cast<long long>(args.n_layers), static_cast<long long>(args.dim),
              static_cast<long long>(args.n_heads), static_cast<long long>(args.n_kv_heads),
              static_cast<long long>(args.head_dim()), args.qk_norm ? " with q/k norms" : "", ffn.c_str(),
              static_cast<long long>(args.vocab_size));
  std::printf("anvil: %s compute%s; %s attention; activation checkpointing %s; %lld micro-batch%s of %lld x %lld "
              "tokens per step; %d thread%s\n",
              dt == DType::bf16 ? "bf16" : "fp32", dt == DType::bf16 ? ", fp32 master weights" : "",
              cfg.model.attn_mask_type == "block_causal" ? "block-causal (documents split at EOS)"
                                                         : "causal (across documents)",
              ac.mode == AcMode::selective_layer ? ("selective every " + std::to_string(ac.every) + " layers").c_str()
                                                 : ac_mode_name(ac.mode),
              static_cast<long long>(par.accum_steps), par.accum_steps == 1 ? "" : "es",
              static_cast<long long>(tc.local_batch_size), static_cast<long long>(tc.seq_len), num_threads(),
              num_threads() == 1 ? "" : "s");
  // The peak's derivation is anvil info's (on a GPU, the GPU's datasheet); the banner says what MFU divides by.
  if (gpu)
    std::printf("anvil: on %s, %s (%s); %s%s; %.3g FLOP per token\n", device.str().c_str(), props.name.c_str(),
                human_bytes(props.memory_bytes).c_str(), mfu.peak.flops_per_s > 0 ? "MFU against " : "",
                cfg.metrics.peak_tflops > 0 ? "metrics.peak_tflops" : mfu.peak.derivation.c_str(), mfu.flops_per_token);
  else
    std::printf("anvil: %s; MFU against a peak of %.3g TFLOP/s per rank (%s)%s; %.3g FLOP per token\n",
                par.description.c_str(), mfu.peak.flops_per_s / 1e12,
                cfg.metrics.peak_tflops > 0 ? "metrics.peak_tflops" : "derived by anvil info",
                par.world_size > 1 ? "; step lines show the fullest rank's memory" : "", mfu.flops_per_token);
  std::printf("anvil: predicted peak memory of %s %s (%s reserved): params %s, grads %s, optimizer %s, "
              "activations %s, comm %s, workspace %s; %s available\n",
              gpu ? device.str().c_str() : detail::concat("rank ", par.rank).c_str(), human_bytes(est.peak_total).c_str(),
              human_bytes(est.peak_reserved).c_str(),
              human_bytes(est.bytes(MemCategory::parameters)).c_str(),
              human_bytes(est.bytes(MemCategory::gradients)).c_str(),
              human_bytes(est.bytes(MemCategory::optimizer_state)).c_str(),
              human_bytes(est.bytes(MemCategory::activations)).c_str(),
              human_bytes(est.bytes(MemCategory::communication)).c_str(),
              human_bytes(est.bytes(MemCategory::workspace)).c_str(), human_bytes(available).c_str());
  return mfu;
}

}  // namespace anvil
