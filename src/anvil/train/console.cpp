#include "anvil/train/console.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "anvil/core/error.h"
#include "anvil/core/parallel.h"
#include "anvil/plan/fit.h"
#include "anvil/plan/flops.h"
#include "anvil/plan/memory.h"

namespace anvil {

namespace {

// The refusal of a run that cannot fit: the model's size, where the bytes go,
// and what would fit instead (smaller micro-batches, recomputation, or FSDP
// over more ranks of this machine's size), in configuration keys.
std::string does_not_fit_message(const ModelArgs& args, const TrainShape& shape, const MemoryEstimate& est,
                                 size_t available) {
  std::string msg = detail::concat(
      args.name, "/", args.flavor, " has ", with_commas(args.num_params()), " parameters; predicted peak memory ",
      human_bytes(est.peak_total), " per process exceeds the ", human_bytes(available), " available (parameters ",
      human_bytes(est.bytes(MemCategory::parameters)), ", gradients ", human_bytes(est.bytes(MemCategory::gradients)),
      ", optimizer state ", human_bytes(est.bytes(MemCategory::optimizer_state)), ", activations ",
      human_bytes(est.bytes(MemCategory::activations)), ", workspace ", human_bytes(est.bytes(MemCategory::workspace)),
      "). To fit: lower training.local_batch_size (", shape.local_batch_size, ") or training.seq_len (", shape.seq_len,
      ")");
  // FSDP divides the model state but not the activations: say how many ranks,
  // each with this much memory, would do under this and lighter AC modes.
  std::vector<std::string> options;
  std::vector<AcMode> modes{shape.ac.mode};
  if (shape.ac.mode == AcMode::none) modes.push_back(AcMode::selective_op);
  modes.push_back(AcMode::full);
  for (AcMode mode : modes) {
    TrainShape s = shape;
    s.ac.mode = mode;
    const int64_t ranks = fsdp_ranks_to_fit(args, s, available);
    const std::string key = mode == AcMode::full           ? "activation_checkpoint.mode = \"full\""
                            : mode == AcMode::selective_op ? "activation_checkpoint.mode = \"selective\" (op)"
                            : mode == AcMode::none         ? "activation_checkpoint.mode = \"none\""
                                                           : "the configured selective layer policy";
    const std::string option = ranks > 0 ? detail::concat(ranks, " FSDP ranks with ", key)
                                         : detail::concat("no number of FSDP ranks with ", key);
    if (std::find(options.begin(), options.end(), option) == options.end()) options.push_back(option);
  }
  msg += "; or shard it: by the estimate, ";
  for (size_t i = 0; i < options.size(); ++i) msg += (i ? (i + 1 == options.size() ? ", or " : ", ") : "") + options[i];
  msg += detail::concat(" would fit, each rank with ", human_bytes(available),
                        " (mpirun -np N anvil train ... --parallelism.data_parallel_shard_degree N); or pick a smaller "
                        "model.flavor");
  return msg;
}

}  // namespace

void route_rank_output(const JobConfig& cfg, const Parallel& par) {
  if (par.rank0()) return;
  const std::filesystem::path dir = std::filesystem::path(cfg.job.dump_folder) / "logs";
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  const std::string path = (dir / ("rank-" + std::to_string(par.rank) + ".log")).string();
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

MfuBasis check_fit_and_print_banner(const JobConfig& cfg, const ModelArgs& args, const Parallel& par, DType dt,
                                    const AcPolicy& ac) {
  const auto& tc = cfg.training;
  const TrainShape shape{tc.local_batch_size, tc.seq_len, dt, ac, par.accum_steps};
  // Each rank keeps 1/(dp_shard·tp) of the weights, gradients and optimizer state.
  const MemoryEstimate est = shard_model_state(
      estimate_memory(args, shape),
      (par.mode == DataParallelMode::fsdp ? par.mesh->layout().dp_shard() : 1) * par.tp_size);
  const size_t available = available_memory_bytes();
  if (available > 0 && est.peak_total > available) throw Error(does_not_fit_message(args, shape, est, available));

  MfuBasis mfu{cfg.metrics.peak_tflops > 0
                   ? PeakFlops{cfg.metrics.peak_tflops * 1e12, "metrics.peak_tflops (configured)"}
                   : cpu_peak_flops(dt, num_threads()),
               flops_per_token(args, tc.seq_len)};
  if (!cfg.job.description.empty()) std::printf("anvil: %s\n", cfg.job.description.c_str());
  std::printf("anvil: %s/%s, %s parameters (%lld layers, dim %lld, %lld heads, %lld kv heads, ffn %lld, vocab %lld)\n",
              args.name.c_str(), args.flavor.c_str(), with_commas(args.num_params()).c_str(),
              static_cast<long long>(args.n_layers), static_cast<long long>(args.dim),
              static_cast<long long>(args.n_heads), static_cast<long long>(args.n_kv_heads),
              static_cast<long long>(args.ffn_hidden_dim()), static_cast<long long>(args.vocab_size));
  std::printf("anvil: %s compute%s, activation checkpointing %s, %lld x %lld tokens per micro-batch, %lld "
              "micro-batch(es) per step, %d threads\n",
              dt == DType::bf16 ? "bf16" : "fp32", dt == DType::bf16 ? " with fp32 master weights" : "",
              ac.mode == AcMode::selective_layer ? ("selective every " + std::to_string(ac.every) + " layers").c_str()
                                                 : ac_mode_name(ac.mode),
              static_cast<long long>(tc.local_batch_size), static_cast<long long>(tc.seq_len),
              static_cast<long long>(par.accum_steps), num_threads());
  std::printf("anvil: %s; peak %s per rank; %.3g FLOP per token\n", par.description.c_str(),
              mfu.peak.derivation.c_str(), mfu.flops_per_token);
  std::printf("anvil: predicted peak memory %s (params %s, grads %s, optimizer %s, activations %s, workspace %s); %s "
              "available\n",
              human_bytes(est.peak_total).c_str(), human_bytes(est.bytes(MemCategory::parameters)).c_str(),
              human_bytes(est.bytes(MemCategory::gradients)).c_str(),
              human_bytes(est.bytes(MemCategory::optimizer_state)).c_str(),
              human_bytes(est.bytes(MemCategory::activations)).c_str(),
              human_bytes(est.bytes(MemCategory::workspace)).c_str(), human_bytes(available).c_str());
  return mfu;
}

}  // namespace anvil
