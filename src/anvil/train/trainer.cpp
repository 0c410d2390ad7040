#include "anvil/train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <array>
#include <functional>
#include <optional>
#include <sstream>
#include <sys/resource.h>

#include "anvil/core/error.h"
#include "anvil/core/parallel.h"
#include "anvil/core/profiler.h"
#include "anvil/data/bpe_tokenizer.h"
#include "anvil/data/brown.h"
#include "anvil/data/shard.h"
#include "anvil/data/stream_loader.h"
#include "anvil/data/text_source.h"
#include "anvil/dist/comm_volume.h"
#include "anvil/dist/ddp.h"
#include "anvil/dist/fsdp.h"
#include "anvil/dist/tensor_parallel.h"
#include "anvil/model/hf_format.h"
#include "anvil/model/llama.h"
#include "anvil/obs/memory_snapshot.h"
#include "anvil/obs/tensorboard.h"
#include "anvil/obs/trace.h"
#include "anvil/ops/adamw.h"
#include "anvil/ops/grad_norm.h"
#include "anvil/plan/fit.h"
#include "anvil/plan/flops.h"
#include "anvil/plan/memory.h"
#include "anvil/train/checkpoint.h"
#include "anvil/train/lr_schedule.h"
#include "anvil/train/metrics.h"
#include "anvil/train/parallel.h"

namespace anvil {

namespace {

// The signal that asked the run to stop: SIGINT (Ctrl-C), or SIGTERM (what
// mpirun sends every rank when it gets Ctrl-C, and what schedulers send).
volatile std::sig_atomic_t g_interrupted = 0;
void on_stop_signal(int sig) { g_interrupted = sig; }

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::string with_commas(int64_t n) {
  const std::string digits = std::to_string(n);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

// The token sources of the configured dataset, for training and validation.
struct DataSources {
  std::unique_ptr<TokenSource> train, validation;  // validation may be null
  std::string description;
};

std::unique_ptr<TokenSource> open_source(const std::string& kind, const std::string& path, const Tokenizer& tok,
                                         uint64_t tokenizer_hash) {
  if (kind == "shards") return std::make_unique<ShardSource>(list_shards(path), tokenizer_hash, tok.vocab_size());
  return std::make_unique<DocumentTokenSource>(std::vector<std::string>{path}, SourceOptions{}, tok);
}

DataSources open_dataset(const JobConfig& cfg, const Tokenizer& tok, uint64_t tokenizer_hash) {
  const auto& t = cfg.training;
  DataSources d;
  if (t.dataset == "brown") {
    // Small enough to tokenize up front; every 20th file is held out, so both
    // splits span all the corpus' genres.
    const std::vector<TextDocument> docs = read_brown_corpus(t.dataset_path);
    std::vector<std::string> train, validation;
    for (size_t i = 0; i < docs.size(); ++i) (i % 20 == 19 ? validation : train).push_back(docs[i].text);
    auto train_src = std::make_unique<TokenVectorSource>("brown/train", tokenize_documents(tok, train));
    d.description = detail::concat("brown at ", t.dataset_path, ": ", train.size(), " train documents (",
                                   with_commas(train_src->unit_tokens(0)), " tokens), ", validation.size(),
                                   " validation");
    d.train = std::move(train_src);
    d.validation = std::make_unique<TokenVectorSource>("brown/validation", tokenize_documents(tok, validation));
    return d;
  }
  d.train = open_source(t.dataset, t.dataset_path, tok, tokenizer_hash);
  d.description = detail::concat(t.dataset, " at ", t.dataset_path, ": ", d.train->num_units(), " file(s)");
  if (!cfg.validation.dataset_path.empty())
    d.validation = open_source(t.dataset, cfg.validation.dataset_path, tok, tokenizer_hash);
  return d;
}

// Captures one step: the profiler's spans and the allocator's timeline, then
// writes the Chrome trace and, if asked, the memory snapshot at the step's peak.
class StepCapture {
 public:
  StepCapture(int64_t step, const std::string& trace_path, const std::string& snapshot_path)
      : step_(step), trace_path_(trace_path), snapshot_path_(snapshot_path) {
    auto& alloc = TrackingAllocator::instance();
    trace_.step = step;
    trace_.live_at_start = alloc.stats().live;
    if (!snapshot_path_.empty()) live_before_ = alloc.live_allocations();
    alloc.clear_timeline();
    alloc.set_timeline(true);
    trace_.start_us = steady_now_us();
    Profiler::instance().start();
  }
  // A step that ends early (skipped, interrupted) writes nothing.
  ~StepCapture() {
    if (finished_) return;
    Profiler::instance().stop();
    TrackingAllocator::instance().set_timeline(false);
    TrackingAllocator::instance().clear_timeline();
  }
  // Returns what was written, for the console.
  std::string finish() {
    finished_ = true;
    auto& alloc = TrackingAllocator::instance();
    Profiler::instance().stop();
    alloc.set_timeline(false);
    trace_.memory_events = alloc.timeline();
    alloc.clear_timeline();
    trace_.spans = Profiler::instance().spans();
    trace_.thread_names = Profiler::instance().thread_names();
    std::string written;
    if (!trace_path_.empty()) {
      write_chrome_trace(trace_, trace_path_);
      written = "trace " + trace_path_;
    }
    if (!snapshot_path_.empty()) {
      MemorySnapshot snap = snapshot_at_peak(live_before_, trace_.memory_events, 25);
      snap.step = step_;
      snap.reason = "peak";
      write_memory_snapshot(snap, snapshot_path_);
      written += (written.empty() ? "" : ", ") + ("memory snapshot " + snapshot_path_ + " (peak " +
                                                  human_bytes(snap.total_bytes) + ")");
    }
    return written;
  }

 private:
  int64_t step_;
  std::string trace_path_, snapshot_path_;
  StepTrace trace_;
  std::vector<LiveAllocation> live_before_;
  bool finished_ = false;
};

// checkpoint.initial_load_path: the weights of an Anvil checkpoint folder or a
// Hugging Face one.
void load_initial_weights(const std::string& path, const ModelArgs& args, ParamStore& ps) {
  namespace fs = std::filesystem;
  ANVIL_CHECK(fs::is_directory(path), "checkpoint.initial_load_path '", path,
              "' is not a folder; give an Anvil checkpoint folder (step-N, holding state.json) or a Hugging Face "
              "folder (config.json and model.safetensors)");
  if (fs::exists(fs::path(path) / "state.json")) return load_checkpoint_model(path, ps);
  if (fs::exists(fs::path(path) / "config.json")) {
    import_hf(path, args, ps);
    return;
  }
  throw Error(detail::concat("checkpoint.initial_load_path '", path,
                             "' holds neither state.json (an Anvil checkpoint) nor config.json (a Hugging Face "
                             "model)"));
}

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

TrainResult train(const JobConfig& cfg) {
  // Ctrl-C (or SIGTERM) from here on stops at the next micro-batch boundary,
  // with a message; under MPI every rank stops at the same one.
  g_interrupted = 0;
  struct RestoreSignals {
    void (*previous_int)(int);
    void (*previous_term)(int);
    ~RestoreSignals() {
      std::signal(SIGINT, previous_int);
      std::signal(SIGTERM, previous_term);
    }
  } restore{std::signal(SIGINT, on_stop_signal), std::signal(SIGTERM, on_stop_signal)};
  // A write past a file-size limit (ulimit -f) fails with EFBIG and a message
  // instead of killing the process.
  std::signal(SIGXFSZ, SIG_IGN);
  Profiler::instance().set_thread_name("main");
  const auto& tc = cfg.training;
  ModelArgs args = model_flavor(cfg.model.name, cfg.model.flavor);
  args.validate();
  // The layout first: every rank checks it, with the same message.
  Parallel par = setup_parallel(cfg, args);
  // Rank 0 speaks for the job; the others' errors still reach stderr.
  if (!par.rank0()) (void)std::freopen("/dev/null", "w", stdout);
  const bool fsdp_mode = par.mode == DataParallelMode::fsdp;
  const DType dt = tc.mixed_precision_param == "bfloat16" ? DType::bf16 : DType::f32;
  const AcPolicy ac = parse_ac_policy(cfg.activation_checkpoint.mode, cfg.activation_checkpoint.selective_ac_option);
  const int64_t accum_steps = par.accum_steps;
  ANVIL_CHECK(tc.seq_len <= args.max_seq_len, "training.seq_len ", tc.seq_len, " exceeds ", args.name, "/",
              args.flavor, "'s max_seq_len ", args.max_seq_len);
  const std::unique_ptr<Tokenizer> tokenizer_ptr =
      load_tokenizer(cfg.model.tokenizer_path.empty() ? "bytes" : cfg.model.tokenizer_path);
  const Tokenizer& tokenizer = *tokenizer_ptr;
  ANVIL_CHECK(tokenizer.vocab_size() <= args.vocab_size, "the ", tokenizer.name(), " tokenizer has ",
              tokenizer.vocab_size(), " tokens but the model's vocabulary is ", args.vocab_size,
              "; pick a flavour with a larger vocabulary or a smaller tokenizer");

  // Refuse, before allocating anything, a run that cannot fit.
  const TrainShape shape{tc.local_batch_size, tc.seq_len, dt, ac, accum_steps};
  // Each rank keeps 1/(dp_shard·tp) of the weights, gradients and optimizer state.
  const MemoryEstimate est = shard_model_state(
      estimate_memory(args, shape), (fsdp_mode ? par.mesh->layout().dp_shard() : 1) * par.tp_size);
  const size_t available = available_memory_bytes();
  if (available > 0 && est.peak_total > available) throw Error(does_not_fit_message(args, shape, est, available));

  const PeakFlops peak = cfg.metrics.peak_tflops > 0
                             ? PeakFlops{cfg.metrics.peak_tflops * 1e12, "metrics.peak_tflops (configured)"}
                             : cpu_peak_flops(dt, num_threads());
  const double fpt = flops_per_token(args, tc.seq_len);
  bool mfu_warned = false;
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
              static_cast<long long>(accum_steps), num_threads());
  std::printf("anvil: %s; peak %s per rank; %.3g FLOP per token\n", par.description.c_str(),
              peak.derivation.c_str(), fpt);
  std::printf("anvil: predicted peak memory %s (params %s, grads %s, optimizer %s, activations %s, workspace %s); %s "
              "available\n",
              human_bytes(est.peak_total).c_str(), human_bytes(est.bytes(MemCategory::parameters)).c_str(),
              human_bytes(est.bytes(MemCategory::gradients)).c_str(),
              human_bytes(est.bytes(MemCategory::optimizer_state)).c_str(),
              human_bytes(est.bytes(MemCategory::activations)).c_str(),
              human_bytes(est.bytes(MemCategory::workspace)).c_str(), human_bytes(available).c_str());

  // Data: packed windows of seq_len + 1 tokens, prepared by a prefetch thread
  // while the step computes.
  const auto t_data = Clock::now();
  const uint64_t tokenizer_hash =
      cfg.model.tokenizer_path.empty() ? byte_tokenizer_hash() : tokenizer_file_hash(cfg.model.tokenizer_path);
  DataSources data = open_dataset(cfg, tokenizer, tokenizer_hash);
  ANVIL_CHECK(!cfg.validation.enable || data.validation, "validation.enable = true needs validation.dataset_path ",
              "for the ", tc.dataset, " dataset (only brown holds out a split by itself)");
  // Data-parallel rank r reads windows r, r + dp, ...: the union of the ranks'
  // batches is the single-process batch of dp times the size.
  StreamLoaderOptions loader_opts{.seq_len = tc.seq_len, .batch_size = tc.local_batch_size, .rank = par.dp_rank,
                                  .world = par.dp_size, .seed = static_cast<uint64_t>(tc.seed)};
  StreamLoader loader(std::move(data.train), loader_opts);
  std::unique_ptr<StreamLoader> val_loader;
  if (cfg.validation.enable) {
    StreamLoaderOptions val_opts = loader_opts;
    val_opts.prefetch = false;
    val_loader = std::make_unique<StreamLoader>(std::move(data.validation), val_opts);
  }
  std::printf("anvil: dataset %s; %s tokenizer (%.2fs)\n", data.description.c_str(), tokenizer.name().c_str(),
              seconds_since(t_data));

  // Model and optimizer. Under FSDP the model holds no weights of its own:
  // FsdpParams keeps this rank's shards and lends each group's gathered
  // weights while the group runs.
  std::optional<ScopedPhase> setup_phase(std::in_place, SpanCategory::step, "model.init");
  // Tensor parallelism: the model holds this tp rank's slices and communicates over the tp group.
  std::unique_ptr<CommTensorParallel> tp;
  if (par.tp_size > 1)
    tp = std::make_unique<CommTensorParallel>(
        par.mesh->tp(), TensorParallel::Options{.sequence_parallel = cfg.parallelism.enable_sequence_parallel,
                                                .loss_parallel = !cfg.parallelism.disable_loss_parallel});
  Llama model(args, dt, tc.seq_len, /*allocate_params=*/!fsdp_mode, tp.get());
  ParamStore& ps = model.params();
  std::unique_ptr<FsdpParams> fsdp;
  std::unique_ptr<DdpGradSync> ddp;
  if (fsdp_mode) {
    const bool hsdp = par.mesh->layout().dp_replicate() > 1;
    fsdp = std::make_unique<FsdpParams>(ps, par.mesh->dp_shard(), hsdp ? &par.mesh->dp_replicate() : nullptr,
                                        parse_reshard_policy(cfg.parallelism.fsdp_reshard_after_forward));
    model.set_hooks(fsdp.get());
  } else if (par.mode == DataParallelMode::ddp) {
    ddp = std::make_unique<DdpGradSync>(ps, par.mesh->dp());
    model.set_hooks(ddp.get());
  }
  // What the layout should send per step, to set against what it does.
  double comm_closed_form = 0;
  {
    std::vector<int64_t> group_numel;
    for (const ParamGroup& g : ps.groups()) group_numel.push_back(g.numel);
    if (fsdp)
      comm_closed_form = fsdp_bytes_per_step(group_numel, par.mesh->layout().dp_shard(), par.mesh->layout().dp_replicate(),
                                             dt == DType::bf16 ? 2 : 4,
                                             parse_reshard_policy(cfg.parallelism.fsdp_reshard_after_forward), accum_steps);
    else if (ddp)
      comm_closed_form = ddp_bytes_per_step(group_numel, par.dp_size);
    if (par.distributed())
      std::printf("anvil: data-parallel traffic per rank per step, closed form: %s\n",
                  human_bytes(static_cast<size_t>(comm_closed_form)).c_str());
  }
  // A whole-model fp32 store (of this tp rank's slices) for initialising and
  // loading a sharded model: each rank fills it and keeps its shard.
  auto full_staging = [&] { return ParamStore(llama_param_specs(args, par.tp_rank, par.tp_size), DType::f32); };
  // Checkpoints hold global tensors; under tensor parallelism they are gathered
  // from, and sliced to, the tp ranks' slices (global_specs carry the offsets).
  const ParamStore global_layout(llama_param_specs(args), DType::f32, /*allocate=*/false);
  // Fills `target` (this rank's layout) with weights read as global tensors by `read`.
  auto load_global_into = [&](ParamStore& target, const std::function<void(ParamStore&)>& read) {
    if (!tp) return read(target);
    ParamStore global(llama_param_specs(args), DType::f32);
    read(global);
    global_flat_to_local(global.specs(), global.master_flat(), target.specs(), target.master_flat());
    target.sync_compute_copy();
  };
  if (fsdp) {
    ParamStore full = full_staging();
    full.init(static_cast<uint64_t>(tc.seed));
    fsdp->load_full_master(full.master_flat());
  } else {
    ps.init(static_cast<uint64_t>(tc.seed));
  }
  setup_phase.reset();
  ps.release_grads();  // each step's backward creates them
  // What this rank's optimizer updates: the whole model, or its shards.
  Tensor& master = fsdp ? fsdp->master() : ps.master_flat();
  const int64_t opt_numel = fsdp ? fsdp->shard_numel() : ps.numel();
  // AdamW's moments are created at the first optimizer step (or by a resume),
  // as in PyTorch: the first step's forward and backward run without them.
  Tensor adam_m, adam_v;
  auto create_optimizer_state = [&] {
    adam_m = Tensor::zeros({opt_numel}, DType::f32, MemCategory::optimizer_state, "adamw.exp_avg");
    adam_v = Tensor::zeros({opt_numel}, DType::f32, MemCategory::optimizer_state, "adamw.exp_avg_sq");
  };
  AdamWConfig adamw{static_cast<float>(cfg.optimizer.lr), static_cast<float>(cfg.optimizer.beta1),
                    static_cast<float>(cfg.optimizer.beta2), static_cast<float>(cfg.optimizer.eps),
                    static_cast<float>(cfg.optimizer.weight_decay)};
  check_adamw_config(adamw);
  const LrSchedule schedule{cfg.optimizer.lr, tc.steps, cfg.lr_scheduler.warmup_steps, cfg.lr_scheduler.decay_ratio,
                            cfg.lr_scheduler.decay_type, cfg.lr_scheduler.min_lr_factor};
  // Rank 0 writes the job's files.
  std::unique_ptr<MetricsLog> metrics;
  if (par.rank0()) metrics = std::make_unique<MetricsLog>(cfg.job.dump_folder);
  const std::filesystem::path dump(cfg.job.dump_folder);
  std::unique_ptr<TensorBoardWriter> tb;
  if (cfg.metrics.enable_tensorboard && par.rank0())
    tb = std::make_unique<TensorBoardWriter>((dump / cfg.metrics.save_tb_folder).string());
  const std::string model_desc = detail::concat(args.name, "/", args.flavor);

  // Resume from the newest checkpoint in the folder (or checkpoint.load_step);
  // failing that, start from checkpoint.initial_load_path's weights.
  int64_t first_step = 1;
  std::unique_ptr<Checkpointer> checkpointer;
  if (cfg.checkpoint.enable) {
    const std::string folder = (dump / cfg.checkpoint.folder).string();
    checkpointer = std::make_unique<Checkpointer>(folder, cfg.checkpoint.keep_latest_k, cfg.checkpoint.async_mode == "async");
    const int64_t resume = cfg.checkpoint.load_step >= 0 ? cfg.checkpoint.load_step : checkpointer->latest_step();
    if (resume >= 0) {
      const auto t_load = Clock::now();
      create_optimizer_state();
      nlohmann::json state;
      // Loads the global tensors into `target` and moments m, v of its layout:
      // under TP through a global staging copy, of which this rank keeps its slices.
      auto load_state = [&](ParamStore& target, Tensor& m, Tensor& v) {
        if (!tp) return checkpointer->load(resume, target, m, v);
        ParamStore global(llama_param_specs(args), DType::f32);
        Tensor gm = Tensor::empty({global.numel()}, DType::f32, MemCategory::workspace, "checkpoint.exp_avg");
        Tensor gv = Tensor::empty({global.numel()}, DType::f32, MemCategory::workspace, "checkpoint.exp_avg_sq");
        nlohmann::json st = checkpointer->load(resume, global, gm, gv);
        global_flat_to_local(global.specs(), global.master_flat(), target.specs(), target.master_flat());
        global_flat_to_local(global.specs(), gm, target.specs(), m);
        global_flat_to_local(global.specs(), gv, target.specs(), v);
        target.sync_compute_copy();
        return st;
      };
      if (fsdp) {  // every rank reads the global tensors and keeps its slices
        ParamStore full = full_staging();
        Tensor m = Tensor::zeros({full.numel()}, DType::f32, MemCategory::workspace, "checkpoint.exp_avg");
        Tensor v = Tensor::zeros({full.numel()}, DType::f32, MemCategory::workspace, "checkpoint.exp_avg_sq");
        state = load_state(full, m, v);
        fsdp->load_full_master(full.master_flat());
        fsdp->scatter_full(m, adam_m);
        fsdp->scatter_full(v, adam_v);
      } else {
        state = load_state(ps, adam_m, adam_v);
      }
      ANVIL_CHECK(state.value("model", model_desc) == model_desc, "checkpoint ", checkpointer->path_of(resume),
                  " holds a ", state.value("model", std::string()), " model but this run trains ", model_desc);
      loader.load_state_json(state.at("loader"));
      first_step = resume + 1;
      std::printf("anvil: resumed from %s (step %lld) in %.2fs\n", checkpointer->path_of(resume).c_str(),
                  static_cast<long long>(resume), seconds_since(t_load));
    }
  }
  if (first_step == 1 && !cfg.checkpoint.initial_load_path.empty()) {
    const auto t_load = Clock::now();
    auto read = [&](ParamStore& store) { load_initial_weights(cfg.checkpoint.initial_load_path, args, store); };
    if (fsdp) {
      ParamStore full = full_staging();
      load_global_into(full, read);
      fsdp->load_full_master(full.master_flat());
    } else {
      load_global_into(ps, read);
    }
    std::printf("anvil: model weights from %s (%.2fs); optimizer, step and data start afresh\n",
                cfg.checkpoint.initial_load_path.c_str(), seconds_since(t_load));
  }

  // Where everything goes, before the first step.
  const std::string trace_dir = (dump / cfg.profiling.save_traces_folder).string();
  const std::string snapshot_dir = (dump / cfg.profiling.save_memory_snapshot_folder).string();
  std::printf("anvil: dump folder %s: metrics %s", cfg.job.dump_folder.c_str(),
              metrics ? metrics->path().c_str() : "(rank 0)");
  if (tb) std::printf(", TensorBoard %s", (dump / cfg.metrics.save_tb_folder).c_str());
  std::printf("\n");
  if (checkpointer)
    std::printf("anvil: checkpoints every %lld steps to %s%s\n", static_cast<long long>(cfg.checkpoint.interval),
                checkpointer->folder().c_str(), cfg.checkpoint.async_mode == "async" ? " (written in the background)" : "");
  if (cfg.profiling.enable_profiling)
    std::printf("anvil: traces of step %lld and every %lld-th step to %s\n", static_cast<long long>(first_step),
                static_cast<long long>(cfg.profiling.profile_freq), trace_dir.c_str());
  if (cfg.profiling.enable_memory_snapshot || cfg.profiling.enable_profiling)
    std::printf("anvil: memory snapshots (at a profiled step's peak%s, or if memory runs out) to %s\n",
                cfg.profiling.enable_memory_snapshot ? "" : ": off", snapshot_dir.c_str());
  std::printf("anvil: report: anvil report %s\n", cfg.job.dump_folder.c_str());
  if (first_step > tc.steps) {
    std::printf("anvil: the checkpoint already reached step %lld of training.steps %lld: nothing to train. Raise "
                "--training.steps, or give another --job.dump_folder to start afresh\n",
                static_cast<long long>(first_step - 1), static_cast<long long>(tc.steps));
    return TrainResult{};
  }
  std::printf("anvil: training to step %lld; Ctrl-C stops cleanly\n", static_cast<long long>(tc.steps));

  // The step's micro-batches are fetched up front, so the loss can be normalised
  // by the token count of the whole step before any backward runs.
  std::vector<Tensor> tokens, targets;
  for (int64_t i = 0; i < accum_steps; ++i) {
    tokens.push_back(Tensor::empty({tc.local_batch_size, tc.seq_len}, DType::i32, MemCategory::workspace, "batch.tokens"));
    targets.push_back(Tensor::empty({tc.local_batch_size, tc.seq_len}, DType::i32, MemCategory::workspace, "batch.targets"));
  }

  TrainResult result;
  auto& alloc = TrackingAllocator::instance();
  alloc.reset_peak();
  const auto t_start = Clock::now();
  auto t_interval = Clock::now();
  double data_seconds = 0;
  int64_t interval_tokens = 0;
  size_t run_peak = 0;  // the largest tracked peak of any logging interval
  int64_t step = first_step;
  // ANVIL_FAULT_KILL_RANK=<rank>:<step> (a test hook): that rank SIGKILLs
  // itself after the step's backward, before its gradients are reduced.
  int stop_signal = 0;  // the signal that stops the run, agreed over the ranks
  const auto stop_requested = [&] {
    stop_signal = par.distributed() ? par.max_over_world(g_interrupted) : static_cast<int>(g_interrupted);
    return stop_signal != 0;
  };
  int64_t fault_kill_step = -1;
  if (const char* v = std::getenv("ANVIL_FAULT_KILL_RANK")) {
    int fault_rank = -1;
    long long fault_step = -1;
    if (std::sscanf(v, "%d:%lld", &fault_rank, &fault_step) == 2 && fault_rank == par.rank) fault_kill_step = fault_step;
  }
  std::array<size_t, kNumMemCategories> steady_live{};
  CommStats interval_comm;  // this rank's data-parallel communication since the last log line
  int64_t interval_steps = 0;
  uint64_t interval_tp_bytes = 0;
  auto checkpoint_meta = [&] {
    // Training draws random numbers only to initialise the weights and order
    // the data, both from the seed; the loader's position carries the rest.
    return CheckpointMeta{loader.state_json(), {{"seed", tc.seed}, {"draws_after_init", 0}}, config_to_toml(cfg),
                          model_desc};
  };
  try {
    for (; step <= tc.steps; ++step) {
      std::unique_ptr<StepCapture> capture;
      // Rank 0 profiles for the job (its files would collide with the others').
      const bool profile_step =
          par.rank0() && (cfg.profiling.enable_profiling || cfg.profiling.enable_memory_snapshot) &&
          (step == first_step || step % cfg.profiling.profile_freq == 0);
      if (profile_step) {
        const std::string name = "step-" + std::to_string(step);
        capture = std::make_unique<StepCapture>(
            step, cfg.profiling.enable_profiling ? (std::filesystem::path(trace_dir) / (name + ".trace.json")).string() : "",
            cfg.profiling.enable_memory_snapshot ? (std::filesystem::path(snapshot_dir) / (name + ".snapshot.json")).string()
                                                 : "");
      }
      std::optional<ScopedPhase> step_phase(std::in_place, SpanCategory::step, "step");
      const auto t_fetch = Clock::now();
      int64_t step_tokens = 0;
      {
        const ScopedPhase phase(SpanCategory::data, "data");
        for (int64_t i = 0; i < accum_steps; ++i) {
          ANVIL_CHECK(loader.next_batch(tokens[static_cast<size_t>(i)], targets[static_cast<size_t>(i)]),
                      "the dataset ran out of tokens");
          step_tokens += tokens[static_cast<size_t>(i)].numel();  // packed windows never ignore a target
        }
      }
      data_seconds += seconds_since(t_fetch);

      ps.release_grads();  // a skipped or interrupted step may have left some
      if (fsdp) fsdp->zero_grad();
      // Every data-parallel rank sees as many tokens; the gradients are summed
      // over the ranks, so each scales by the whole step's count.
      const int64_t global_step_tokens = step_tokens * par.dp_size;
      double loss_sum = 0;
      int64_t loss_tokens = 0;
      int64_t stopped_after = 0;  // micro-batches done when a stop was agreed, 0 while running
      for (int64_t i = 0; i < accum_steps; ++i) {
        if (ddp) ddp->set_sync(i == accum_steps - 1);
        const CrossEntropyResult r = model.forward_backward(tokens[static_cast<size_t>(i)],
                                                            targets[static_cast<size_t>(i)],
                                                            1.0f / static_cast<float>(global_step_tokens), ac);
        loss_sum += r.loss_sum;
        loss_tokens += r.num_tokens;
        // A signal reaches one rank, or the ranks at different moments: they
        // agree here, so all leave the step after the same micro-batch and no
        // rank is left waiting in a collective the others skipped.
        if (stop_requested()) {
          stopped_after = i + 1;
          break;
        }
      }
      if (fault_kill_step == step) std::raise(SIGKILL);  // a test hook: this rank dies mid-step
      if (ddp) ddp->finish();
      if (fsdp) fsdp->finish();
      {
        const CommStats cs = ddp ? ddp->tracker().take() : fsdp ? fsdp->tracker().take() : CommStats{};
        interval_comm.bytes += cs.bytes;
        interval_comm.in_flight_s += cs.in_flight_s;
        interval_comm.blocked_s += cs.blocked_s;
        interval_comm.collectives += cs.collectives;
        ++interval_steps;
        if (par.distributed() && par.tp_size > 1) {  // tensor-parallel traffic, counted by its communicator
          interval_tp_bytes += par.mesh->tp().counters().total_bytes();
          par.mesh->tp().reset_counters();
        }
      }
      if (par.distributed()) {
        float totals[2] = {static_cast<float>(loss_sum), static_cast<float>(loss_tokens)};
        par.sum_over_dp(totals, 2);
        loss_sum = totals[0];
        loss_tokens = static_cast<int64_t>(totals[1]);
      }
      if (stopped_after > 0) {
        std::printf("anvil: interrupted (%s) during step %lld after micro-batch %lld of %lld; its gradients were "
                    "discarded. %lld steps completed.\n",
                    strsignal(stop_signal), static_cast<long long>(step), static_cast<long long>(stopped_after),
                    static_cast<long long>(accum_steps), static_cast<long long>(step - 1));
        if (par.distributed())
          std::fprintf(stderr, "anvil: rank %d: stopped in step %lld after micro-batch %lld of %lld\n", par.rank,
                       static_cast<long long>(step), static_cast<long long>(stopped_after),
                       static_cast<long long>(accum_steps));
        result.interrupted = true;
        break;
      }
      const double loss = loss_sum / static_cast<double>(loss_tokens);
      double grad_norm, lr;
      {
        const ScopedPhase phase(SpanCategory::optimizer, "optimizer");
        Tensor& grad = fsdp ? fsdp->grads() : ps.grad_flat();
        const Tensor grads[] = {grad};
        // Under TP each global element is counted on one tp rank only (replicated norms on tp rank 0).
        double sum_sq = tp ? grad_sum_of_squares(grads_counted_once(ps, grad, par.tp_rank, fsdp.get(),
                                                                    fsdp ? par.mesh->dp_shard().rank() : 0))
                           : grad_sum_of_squares(grads);
        if (fsdp || tp) {  // each shard holds part of the gradient; replicas hold the same parts
          float part = static_cast<float>(sum_sq);
          Tensor t = Tensor::empty({1}, DType::f32, MemCategory::communication, "grad_norm.sum");
          t.data<float>()[0] = part;
          if (fsdp) par.mesh->dp_shard().all_reduce(t);
          if (tp) par.mesh->tp().all_reduce(t);
          sum_sq = t.data<float>()[0];
        }
        grad_norm = grad_norm_from_sum_of_squares(sum_sq);
        lr = schedule.at(step);
        if (!std::isfinite(loss) || !std::isfinite(grad_norm)) {
          if (!tc.skip_nonfinite_steps)
            throw Error(detail::concat("step ", step, ": the ", std::isfinite(loss) ? "gradient norm" : "loss",
                                       " is not finite (loss ", loss, ", grad_norm ", grad_norm,
                                       "); lower optimizer.lr, keep training.max_norm > 0, or set "
                                       "training.skip_nonfinite_steps = true to skip such steps"));
          std::printf("anvil: step %lld skipped: loss %g, grad_norm %g are not finite\n", static_cast<long long>(step),
                      loss, grad_norm);
          continue;
        }
        const float clip = tc.max_norm > 0 ? static_cast<float>(clip_coefficient(grad_norm, tc.max_norm)) : 1.0f;
        adamw.lr = static_cast<float>(lr);
        if (!adam_m.defined()) create_optimizer_state();
        Tensor* compute_copy = dt == DType::bf16 ? (fsdp ? &fsdp->compute() : &ps.compute_flat()) : nullptr;
        adamw_step(adamw, step, master, grad, adam_m, adam_v, compute_copy, clip);
        // What this rank keeps between steps, with this step's gradients: the
        // figure the ZeRO closed forms predict.
        steady_live = alloc.stats().live;
        ps.release_grads();
        if (fsdp) fsdp->release_grads();
      }
      step_phase.reset();

      if (result.steps_done == 0) result.first_loss = loss;
      result.last_loss = loss;
      result.steps_done = step;
      interval_tokens += step_tokens;
      if (step % cfg.metrics.log_freq == 0 || step == tc.steps) {
        const double secs = seconds_since(t_interval);
        StepLog log;
        log.step = step;
        log.loss = loss;
        log.grad_norm = grad_norm;
        log.lr = lr;
        // Per rank, as torchtitan: a tp group's ranks share their tokens' work.
        log.tokens_per_s = static_cast<double>(interval_tokens) / secs / par.tp_size;
        log.tflops = fpt * log.tokens_per_s / 1e12;
        log.mfu_pct = 100.0 * fpt * log.tokens_per_s / peak.flops_per_s;
        // Never printed silently: above 100% either the peak is wrong for this
        // CPU or the FLOP count overstates the work (causal attention counted whole).
        if (log.mfu_pct > 100.0 && !mfu_warned) {
          std::fprintf(stderr,
                       "anvil: warning: MFU %.0f%% is above 100%%: the peak (%s) is below what this run computes; "
                       "set metrics.peak_tflops to this machine's real peak\n",
                       log.mfu_pct, peak.derivation.c_str());
          mfu_warned = true;
        }
        log.memory = alloc.stats();
        log.data_pct = 100.0 * data_seconds / secs;
        log.elapsed_s = seconds_since(t_start);
        log.world_size = par.world_size;
        log.live_after_optimizer = steady_live;
        if (par.distributed() && interval_steps > 0) {
          log.comm_bytes_per_step = static_cast<double>(interval_comm.bytes) / static_cast<double>(interval_steps);
          log.comm_in_flight_s = interval_comm.in_flight_s / static_cast<double>(interval_steps);
          log.comm_blocked_s = interval_comm.blocked_s / static_cast<double>(interval_steps);
          log.comm_hidden_pct = 100.0 * interval_comm.hidden_share();
          log.comm_bytes_closed_form = comm_closed_form;
          log.tp_comm_bytes_per_step = static_cast<double>(interval_tp_bytes) / static_cast<double>(interval_steps);
        }
        interval_comm = {};
        interval_steps = 0;
        interval_tp_bytes = 0;
        if (par.distributed()) {  // every rank reports; rank 0 prints the fullest
          const std::vector<double> mib = par.gather_world(static_cast<double>(log.memory.peak_total) / (1 << 20));
          log.tokens_per_s_by_rank = par.gather_world(log.tokens_per_s);
          for (double m : mib) log.peak_mib_by_rank.push_back(m);
          log.max_memory_over_ranks = log.memory.peak_total;
          for (double m : mib)
            log.max_memory_over_ranks = std::max(log.max_memory_over_ranks, static_cast<size_t>(m * (1 << 20)));
        }
        if (metrics) metrics->log(log);
        if (tb) {
          tb->add_scalar("loss/train", log.loss, step);
          tb->add_scalar("grad_norm", log.grad_norm, step);
          tb->add_scalar("lr", log.lr, step);
          tb->add_scalar("throughput/tokens_per_s", log.tokens_per_s, step);
          tb->add_scalar("throughput/tflops", log.tflops, step);
          tb->add_scalar("throughput/mfu_pct", log.mfu_pct, step);
          tb->add_scalar("throughput/data_loading_pct", log.data_pct, step);
          tb->add_scalar("memory/max_active_bytes", static_cast<double>(log.memory.peak_total), step);
          for (int c = 0; c < kNumMemCategories; ++c)
            tb->add_scalar(std::string("memory/") + category_name(static_cast<MemCategory>(c)),
                           static_cast<double>(log.memory.peak[c]), step);
          tb->flush();
        }
        run_peak = std::max(run_peak, log.memory.peak_total);
        alloc.reset_peak();
        t_interval = Clock::now();
        interval_tokens = 0;
        data_seconds = 0;
      }
      if (cfg.validation.enable && step % cfg.validation.freq == 0) {
        double vsum = 0;
        int64_t vtok = 0;
        for (int64_t i = 0; i < cfg.validation.steps; ++i) {
          ANVIL_CHECK(val_loader->next_batch(tokens[0], targets[0]), "the validation set ran out of tokens");
          const CrossEntropyResult r = model.forward(tokens[0], targets[0]);
          vsum += r.loss_sum, vtok += r.num_tokens;
        }
        if (par.distributed()) {
          float totals[2] = {static_cast<float>(vsum), static_cast<float>(vtok)};
          par.sum_over_dp(totals, 2);
          vsum = totals[0];
          vtok = static_cast<int64_t>(totals[1]);
        }
        val_loader->set_state(StreamState{});  // the same held-out batches every time
        const double vloss = vsum / static_cast<double>(vtok);
        std::printf("step %5lld | validation loss %.4f over %lld tokens\n", static_cast<long long>(step), vloss,
                    static_cast<long long>(vtok));
        if (metrics) metrics->log_validation(step, vloss, vtok);
        if (tb) {
          tb->add_scalar("loss/validation", vloss, step);
          tb->flush();
        }
      }
      const bool last = step == tc.steps;
      if (checkpointer && (step % cfg.checkpoint.interval == 0 || last)) {
        const bool model_only = last && cfg.checkpoint.last_save_model_only;
        const DType model_dtype =
            model_only && cfg.checkpoint.export_dtype == "bfloat16" ? DType::bf16 : DType::f32;
        // Checkpoints hold global tensors whatever the layout: FSDP gathers
        // them (every rank takes part), and rank 0 writes.
        Tensor full_master, full_m, full_v;
        if (fsdp) {
          full_master = fsdp->gather_full_master();
          if (!model_only) full_m = fsdp->gather_full(adam_m), full_v = fsdp->gather_full(adam_v);
        }
        const Tensor* w = fsdp ? &full_master : &ps.master_flat();
        const Tensor* m = model_only ? nullptr : (fsdp ? &full_m : &adam_m);
        const Tensor* v = model_only ? nullptr : (fsdp ? &full_v : &adam_v);
        const std::vector<ParamSpec>* specs = &ps.specs();
        Tensor global_w, global_m, global_v;
        if (tp) {  // then the tp ranks' slices into global tensors (every rank takes part)
          auto gather = [&](const Tensor& local) {
            return gather_tp_global(par.mesh->tp(), ps.specs(), local, global_layout.specs(), global_layout.numel());
          };
          global_w = gather(*w), w = &global_w;
          if (m) global_m = gather(*m), global_v = gather(*v), m = &global_m, v = &global_v;
          specs = &global_layout.specs();
        }
        if (par.rank0()) checkpointer->save(step, *specs, *w, m, v, checkpoint_meta(), model_dtype);
      }
      if (capture) {
        const std::string written = capture->finish();
        if (!written.empty()) std::printf("anvil: step %lld: %s\n", static_cast<long long>(step), written.c_str());
      }
      if (stop_requested()) {
        std::printf("anvil: interrupted (%s) after step %lld of %lld.\n", strsignal(stop_signal),
                    static_cast<long long>(step), static_cast<long long>(tc.steps));
        if (par.distributed())
          std::fprintf(stderr, "anvil: rank %d: stopped after step %lld\n", par.rank, static_cast<long long>(step));
        result.interrupted = true;
        break;
      }
    }
    if (checkpointer) checkpointer->wait();  // a background save finishes before the run reports done
  } catch (const OutOfMemoryError& e) {
    // What was live when memory ran out, for the user to see where it went.
    Profiler::instance().stop();
    alloc.set_timeline(false);
    MemorySnapshot snap = snapshot_now(alloc.live_allocations(), 25);
    snap.step = step;
    snap.reason = "out_of_memory";
    const std::string name = "step-" + std::to_string(step) +
                             (par.distributed() ? ".rank-" + std::to_string(par.rank) : std::string()) + ".oom.snapshot.json";
    const std::string path = (std::filesystem::path(snapshot_dir) / name).string();
    write_memory_snapshot(snap, path);
    throw OutOfMemoryError(detail::concat(e.what(), "; the ", snap.num_live, " live tensors are listed in ", path,
                                          ". Lower training.local_batch_size or training.seq_len, use "
                                          "activation_checkpoint.mode = \"full\", or pick a smaller model.flavor"));
  }
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  if (!result.interrupted)
    std::printf("anvil: done: %lld steps, loss %.4f -> %.4f in %.1fs; peak RSS %s, peak tracked %s\n",
                static_cast<long long>(result.steps_done), result.first_loss, result.last_loss,
                seconds_since(t_start), human_bytes(static_cast<size_t>(usage.ru_maxrss) * 1024).c_str(),
                human_bytes(std::max(run_peak, alloc.stats().peak_total)).c_str());
  return result;
}

}  // namespace anvil
