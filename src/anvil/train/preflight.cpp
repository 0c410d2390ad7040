#include "anvil/train/preflight.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "anvil/core/error.h"
#include "anvil/core/free_cores.h"
#include "anvil/core/parallel_for.h"
#include "anvil/train/console.h"

namespace anvil {

int ranks_on_this_machine() {
  for (const char* v : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"}) {
    const char* s = std::getenv(v);
    if (s != nullptr && std::atoi(s) > 0) return std::atoi(s);  // Slurm's "4(x2)" reads as 4
  }
  return 1;
}

void share_cores_between_local_ranks() {
  const int ranks = ranks_on_this_machine();
  if (ranks <= 1) {
    // Alone on the machine: the cores other processes leave free (several
    // local ranks would see each other's start-up as load, so they split the cores instead).
    if (const std::string line = size_threads_to_free_cores(); !line.empty()) std::printf("anvil: %s\n", line.c_str());
    return;
  }
  if (std::getenv("OMP_NUM_THREADS") != nullptr) return;
  const int cores = omp_get_num_procs(), threads = std::max(1, cores / ranks);
  if (threads >= num_threads()) return;
  set_num_threads(threads);
  std::printf("anvil: %d ranks share this machine's %d cores: %d OpenMP thread(s) each (OMP_NUM_THREADS overrides)\n",
              ranks, cores, threads);
}

namespace {

// The fullest rank's predicted peak, or 0 when the configuration is invalid
// for this model (a degree that does not divide it, a batch that does not split).
size_t worst_peak(const JobConfig& cfg, const ModelArgs& args, int world_size) {
  try {
    const LayoutEstimate est = estimate_layout(cfg, args, world_size);
    size_t worst = 0;
    for (const RankEstimate& r : est.ranks) worst = std::max(worst, r.memory.peak_reserved);
    return worst;
  } catch (const Error&) {
    return 0;
  }
}

struct Change {
  std::string what, flags;
  JobConfig cfg;
};

// The activation-checkpointing modes lighter than the configured one, lightest last.
std::vector<Change> lighter_ac(const JobConfig& cfg) {
  std::vector<Change> out;
  const AcMode mode = activation_checkpoint_policy(cfg).mode;
  if (mode == AcMode::none || mode == AcMode::selective_layer) {
    Change c{"activation_checkpoint.mode = \"selective\" (op)",
             "--activation_checkpoint.mode selective --activation_checkpoint.selective_ac_option op", cfg};
    c.cfg.activation_checkpoint.mode = "selective";
    c.cfg.activation_checkpoint.selective_ac_option = "op";
    out.push_back(c);
  }
  if (mode != AcMode::full) {
    Change c{"activation_checkpoint.mode = \"full\"", "--activation_checkpoint.mode full", cfg};
    c.cfg.activation_checkpoint.mode = "full";
    out.push_back(c);
  }
  return out;
}

// The categories with bytes, largest first ("activations 12.0 GiB, ..."): the first is what to attack.
std::string largest_first(const MemoryEstimate& m) {
  std::vector<MemCategory> cats;
  for (int c = 0; c < kNumMemCategories; ++c) cats.push_back(static_cast<MemCategory>(c));
  std::stable_sort(cats.begin(), cats.end(), [&](MemCategory a, MemCategory b) { return m.bytes(a) > m.bytes(b); });
  std::string parts;
  for (MemCategory c : cats)
    if (m.bytes(c) > 0) parts.append(parts.empty() ? "" : ", ").append(category_name(c)).append(" ").append(human_bytes(m.bytes(c)));
  return parts;
}

// The GPU's reserved peak of `cfg` by the dry run of the GPU path, or 0 when the change is invalid.
size_t gpu_reserved_peak(const JobConfig& cfg, const ModelArgs& args, Device device) {
  try {
    return dry_run_rank(cfg, args, 1, 0, nullptr, device).device_memory.peak_reserved;
  } catch (const Error&) {
    return 0;
  }
}

}  // namespace

std::vector<FitOption> fitting_changes(const JobConfig& cfg, const ModelArgs& args, int world_size, size_t per_rank) {
  std::vector<FitOption> out;
  auto consider = [&](const Change& c, int world) {
    const size_t peak = worst_peak(c.cfg, args, world);
    if (peak == 0 || peak > per_rank) return false;
    out.push_back({c.what, c.flags, world, peak});
    return true;
  };
  const auto& p = cfg.parallelism;
  // On the same ranks: a lighter AC mode, then a smaller micro-batch (halved
  // until it fits; the global batch stays, accumulation makes up the rest).
  std::vector<Change> same_ranks = lighter_ac(cfg);
  const bool pipeline = p.pipeline_parallel_degree > 1;
  for (int64_t b = (pipeline ? p.pipeline_parallel_microbatch_size : cfg.training.local_batch_size) / 2; b >= 1;
       b /= 2) {
    Change c{"", "", cfg};
    if (pipeline) {
      c.what = detail::concat("parallelism.pipeline_parallel_microbatch_size = ", b);
      c.flags = detail::concat("--parallelism.pipeline_parallel_microbatch_size ", b);
      c.cfg.parallelism.pipeline_parallel_microbatch_size = b;
    } else {
      c.what = detail::concat("training.local_batch_size = ", b);
      c.flags = detail::concat("--training.local_batch_size ", b);
      c.cfg.training.local_batch_size = b;
      if (cfg.training.global_batch_size < 0) {  // one local batch per rank before: keep the tokens per step
        const int64_t dp = std::max<int64_t>(1, world_size / (p.pipeline_parallel_degree * p.tensor_parallel_degree));
        c.cfg.training.global_batch_size = cfg.training.local_batch_size * dp;
        c.flags += detail::concat(" --training.global_batch_size ", c.cfg.training.global_batch_size);
      }
    }
    const size_t peak = worst_peak(c.cfg, args, world_size);
    if (peak > 0 && peak <= per_rank) {
      same_ranks.push_back(c);
      break;
    }
  }
  for (const Change& c : same_ranks) consider(c, world_size);
  // More ranks: twice the pipeline stages; or the FSDP shards doubled until
  // the model state fits, under the configured AC mode and each lighter one.
  {
    Change c{detail::concat("parallelism.pipeline_parallel_degree = ", p.pipeline_parallel_degree * 2),
             detail::concat("--parallelism.pipeline_parallel_degree ", p.pipeline_parallel_degree * 2), cfg};
    c.cfg.parallelism.pipeline_parallel_degree *= 2;
    consider(c, world_size * 2);
  }
  // Context parallelism: every sequence over twice (four times, ...) the cp
  // ranks, which divides the activations; the first degree that fits.
  for (int64_t factor = 2; factor <= 64 && p.pipeline_parallel_degree == 1; factor *= 2) {
    const int64_t cp = p.context_parallel_degree * factor;
    if (cfg.training.seq_len % (2 * cp) != 0) break;
    Change c{detail::concat("parallelism.context_parallel_degree = ", cp),
             detail::concat("--parallelism.context_parallel_degree ", cp), cfg};
    c.cfg.parallelism.context_parallel_degree = cp;
    if (consider(c, world_size * static_cast<int>(factor))) break;
  }
  const int shards = std::max<int>(1, p.data_parallel_shard_degree > 0 ? static_cast<int>(p.data_parallel_shard_degree)
                                                                        : world_size / static_cast<int>(
                                                                              p.pipeline_parallel_degree *
                                                                              p.data_parallel_replicate_degree *
                                                                              p.tensor_parallel_degree));
  std::vector<Change> modes{{"", "", cfg}};
  for (const Change& c : lighter_ac(cfg)) modes.push_back(c);
  for (const Change& m : modes) {
    for (int factor = 2; factor <= (1 << 14); factor *= 2) {
      Change c = m;
      c.cfg.parallelism.data_parallel_shard_degree = shards * factor;
      c.what = detail::concat(shards * factor, " FSDP ranks", m.what.empty() ? "" : " with ", m.what);
      c.flags = detail::concat("--parallelism.data_parallel_shard_degree ", shards * factor,
                               m.flags.empty() ? "" : " ", m.flags);
      if (consider(c, world_size * factor)) break;
    }
  }
  std::stable_sort(out.begin(), out.end(), [](const FitOption& a, const FitOption& b) { return a.world_size < b.world_size; });
  return out;
}

std::string fit_refusal(const JobConfig& cfg, const ModelArgs& args, const ParallelDims& par, const RankEstimate& rank,
                        size_t available, int local_ranks) {
  const size_t share = available / static_cast<size_t>(std::max(1, local_ranks));
  if (available == 0 || rank.memory.peak_reserved <= share) return "";

  std::string where = detail::concat("rank ", rank.rank);
  if (par.pp_size > 1) {
    where += " (pipeline stage";
    for (size_t i = 0; i < rank.stages.size(); ++i) where.append(i ? ", " : " ").append(std::to_string(rank.stages[i]));
    where += ")";
  }
  const std::string parts = largest_first(rank.memory);
  std::string msg = detail::concat(
      args.name, "/", args.flavor, " has ", with_commas(args.num_params()), " parameters; predicted peak memory of ",
      where, " is ", human_bytes(rank.memory.peak_reserved), ", over the ", human_bytes(share), " available to it (",
      human_bytes(available), " on this machine", local_ranks > 1 ? detail::concat(" shared by ", local_ranks, " ranks") : "",
      "); largest first: ", parts, " (layout: ", par.description, "). ");
  const std::vector<FitOption> options = fitting_changes(cfg, args, par.world_size, share);
  if (options.empty()) {
    msg +=
        "No single change fits by the estimate (a lighter activation checkpointing, a smaller micro-batch, twice "
        "the pipeline stages, up to 64x the context-parallel ranks, up to 16384x the FSDP ranks); pick a smaller "
        "model.flavor or training.seq_len";
  } else {
    msg += "What would fit, by the same estimate:";
    for (size_t i = 0; i < options.size() && i < 4; ++i) {
      const FitOption& o = options[i];
      msg += detail::concat(i ? ";" : "", " ", o.what, " (", o.flags, "): ", human_bytes(o.peak), " on the fullest of ",
                            o.world_size, " rank", o.world_size > 1 ? "s" : "");
    }
    msg += detail::concat(". Each rank with ", human_bytes(share),
                          "; more ranks: mpirun -np N anvil train ... with the flags shown");
  }
  return msg;
}

std::string gpu_fit_refusal(const JobConfig& cfg, const ModelArgs& args, const RankEstimate& rank,
                            const DeviceProperties& gpu) {
  const MemoryEstimate& m = rank.device_memory;
  if (gpu.memory_bytes == 0 || m.peak_reserved <= gpu.memory_bytes) return "";
  std::string msg = detail::concat(args.name, "/", args.flavor, " has ", with_commas(args.num_params()),
                                   " parameters; the dry run of the GPU path reserves ", human_bytes(m.peak_reserved),
                                   " at its peak on ", rank.device.str(), ", over the ", human_bytes(gpu.memory_bytes),
                                   " of its ", gpu.name, "; largest first: ", largest_first(m), ". ");
  // The changes one GPU can take: a lighter activation checkpointing, then a
  // smaller micro-batch (halved until it fits; accumulation keeps the global batch).
  std::vector<Change> changes = lighter_ac(cfg);
  for (int64_t b = cfg.training.local_batch_size / 2; b >= 1; b /= 2) {
    Change c{detail::concat("training.local_batch_size = ", b, " with accumulation"),
             detail::concat("--training.local_batch_size ", b, " --training.global_batch_size ",
                            cfg.training.global_batch_size > 0 ? cfg.training.global_batch_size
                                                               : cfg.training.local_batch_size),
             cfg};
    c.cfg.training.local_batch_size = b;
    if (c.cfg.training.global_batch_size <= 0) c.cfg.training.global_batch_size = cfg.training.local_batch_size;
    changes.push_back(c);
  }
  std::string fits;
  for (const Change& c : changes) {
    const size_t peak = gpu_reserved_peak(c.cfg, args, rank.device);
    if (peak == 0 || peak > gpu.memory_bytes) continue;
    fits += detail::concat(fits.empty() ? "" : "; ", c.what, " (", c.flags, "): ", human_bytes(peak), " reserved");
    if (c.cfg.training.local_batch_size != cfg.training.local_batch_size) break;  // the largest micro-batch that fits
  }
  msg += fits.empty() ? std::string("No lighter activation checkpointing or smaller micro-batch fits by the dry run; pick "
                                    "a smaller model.flavor or training.seq_len, or train on the CPU")
                      : "What would fit, by the same dry run: " + fits;
  return msg;
}

RankEstimate check_rank_fits(const JobConfig& cfg, const ModelArgs& args, const ParallelDims& par, size_t available,
                             int local_ranks) {
  const RankEstimate mine = dry_run_rank(cfg, args, par.world_size, par.rank);
  const std::string refusal = fit_refusal(cfg, args, par, mine, available, local_ranks);
  if (!refusal.empty()) throw Error(refusal);
  return mine;
}

}  // namespace anvil
