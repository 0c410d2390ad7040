#include "anvil/train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <sys/resource.h>

#include "anvil/core/error.h"
#include "anvil/core/parallel.h"
#include "anvil/data/bpe_tokenizer.h"
#include "anvil/data/brown.h"
#include "anvil/data/shard.h"
#include "anvil/data/stream_loader.h"
#include "anvil/data/text_source.h"
#include "anvil/model/llama.h"
#include "anvil/ops/adamw.h"
#include "anvil/ops/grad_norm.h"
#include "anvil/plan/memory.h"
#include "anvil/train/checkpoint.h"
#include "anvil/train/lr_schedule.h"
#include "anvil/train/metrics.h"

namespace anvil {

namespace {

volatile std::sig_atomic_t g_interrupted = 0;
void on_sigint(int) { g_interrupted = 1; }

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

void check_supported(const JobConfig& cfg) {
  const auto& p = cfg.parallelism;
  ANVIL_CHECK(p.data_parallel_replicate_degree == 1 && (p.data_parallel_shard_degree == 1 || p.data_parallel_shard_degree == -1) &&
                  p.tensor_parallel_degree == 1 && p.pipeline_parallel_degree == 1,
              "[parallelism] degrees other than 1 need distributed training, which this build does not have yet; "
              "set them to 1 (data_parallel_shard_degree may stay -1)");
}

}  // namespace

TrainResult train(const JobConfig& cfg) {
  // Ctrl-C from here on stops at the next micro-batch boundary, with a message.
  g_interrupted = 0;
  struct RestoreSigint {
    void (*previous)(int);
    ~RestoreSigint() { std::signal(SIGINT, previous); }
  } restore{std::signal(SIGINT, on_sigint)};
  check_supported(cfg);
  const auto& tc = cfg.training;
  ModelArgs args = model_flavor(cfg.model.name, cfg.model.flavor);
  args.validate();
  const DType dt = tc.mixed_precision_param == "bfloat16" ? DType::bf16 : DType::f32;
  const AcPolicy ac = parse_ac_policy(cfg.activation_checkpoint.mode, cfg.activation_checkpoint.selective_ac_option);
  const int64_t global_batch = tc.global_batch_size < 0 ? tc.local_batch_size : tc.global_batch_size;
  ANVIL_CHECK(global_batch % tc.local_batch_size == 0, "training.global_batch_size ", global_batch,
              " must be a multiple of training.local_batch_size ", tc.local_batch_size);
  const int64_t accum_steps = global_batch / tc.local_batch_size;
  ANVIL_CHECK(tc.seq_len <= args.max_seq_len, "training.seq_len ", tc.seq_len, " exceeds ", args.name, "/",
              args.flavor, "'s max_seq_len ", args.max_seq_len);
  const std::unique_ptr<Tokenizer> tokenizer_ptr =
      load_tokenizer(cfg.model.tokenizer_path.empty() ? "bytes" : cfg.model.tokenizer_path);
  const Tokenizer& tokenizer = *tokenizer_ptr;
  ANVIL_CHECK(tokenizer.vocab_size() <= args.vocab_size, "the ", tokenizer.name(), " tokenizer has ",
              tokenizer.vocab_size(), " tokens but the model's vocabulary is ", args.vocab_size,
              "; pick a flavour with a larger vocabulary or a smaller tokenizer");

  // Refuse, before allocating anything, a run that cannot fit.
  const TrainShape shape{tc.local_batch_size, tc.seq_len, dt, ac};
  const MemoryEstimate est = estimate_memory(args, shape);
  const size_t available = available_memory_bytes();
  if (available > 0 && est.peak_total > available) {
    throw Error(detail::concat(
        "predicted peak memory ", human_bytes(est.peak_total), " exceeds the ", human_bytes(available),
        " available (parameters ", human_bytes(est.bytes(MemCategory::parameters)), ", gradients ",
        human_bytes(est.bytes(MemCategory::gradients)), ", optimizer state ",
        human_bytes(est.bytes(MemCategory::optimizer_state)), ", activations ",
        human_bytes(est.bytes(MemCategory::activations)),
        "); lower training.local_batch_size or training.seq_len, use activation_checkpoint.mode = \"full\", "
        "or pick a smaller model.flavor"));
  }

  const PeakFlops peak = cfg.metrics.peak_tflops > 0
                             ? PeakFlops{cfg.metrics.peak_tflops * 1e12, "metrics.peak_tflops (configured)"}
                             : cpu_peak_flops(dt, num_threads());
  const double fpt = flops_per_token(args, tc.seq_len);
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
  std::printf("anvil: peak %s; %.3g FLOP per token\n", peak.derivation.c_str(), fpt);
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
  StreamLoaderOptions loader_opts{.seq_len = tc.seq_len, .batch_size = tc.local_batch_size,
                                  .seed = static_cast<uint64_t>(tc.seed)};
  StreamLoader loader(std::move(data.train), loader_opts);
  std::unique_ptr<StreamLoader> val_loader;
  if (cfg.validation.enable) {
    StreamLoaderOptions val_opts = loader_opts;
    val_opts.prefetch = false;
    val_loader = std::make_unique<StreamLoader>(std::move(data.validation), val_opts);
  }
  std::printf("anvil: dataset %s; %s tokenizer (%.2fs)\n", data.description.c_str(), tokenizer.name().c_str(),
              seconds_since(t_data));

  // Model and optimizer.
  Llama model(args, dt, tc.seq_len);
  model.params().init(static_cast<uint64_t>(tc.seed));
  ParamStore& ps = model.params();
  Tensor adam_m = Tensor::zeros({ps.numel()}, DType::f32, MemCategory::optimizer_state, "adamw.m");
  Tensor adam_v = Tensor::zeros({ps.numel()}, DType::f32, MemCategory::optimizer_state, "adamw.v");
  AdamWConfig adamw{static_cast<float>(cfg.optimizer.lr), static_cast<float>(cfg.optimizer.beta1),
                    static_cast<float>(cfg.optimizer.beta2), static_cast<float>(cfg.optimizer.eps),
                    static_cast<float>(cfg.optimizer.weight_decay)};
  check_adamw_config(adamw);
  const LrSchedule schedule{cfg.optimizer.lr, tc.steps, cfg.lr_scheduler.warmup_steps, cfg.lr_scheduler.decay_ratio,
                            cfg.lr_scheduler.decay_type, cfg.lr_scheduler.min_lr_factor};
  MetricsLog metrics(cfg.job.dump_folder);

  // Resume from the newest checkpoint in the folder (or checkpoint.load_step).
  int64_t first_step = 1;
  std::unique_ptr<Checkpointer> checkpointer;
  if (cfg.checkpoint.enable) {
    const std::string folder = (std::filesystem::path(cfg.job.dump_folder) / cfg.checkpoint.folder).string();
    checkpointer = std::make_unique<Checkpointer>(folder, cfg.checkpoint.keep_latest_k);
    const int64_t resume = cfg.checkpoint.load_step >= 0 ? cfg.checkpoint.load_step : checkpointer->latest_step();
    if (resume >= 0) {
      const auto t_load = Clock::now();
      loader.load_state_json(checkpointer->load(resume, ps, adam_m, adam_v));
      first_step = resume + 1;
      std::printf("anvil: resumed from %s (step %lld) in %.2fs\n", checkpointer->path_of(resume).c_str(),
                  static_cast<long long>(resume), seconds_since(t_load));
    }
    std::printf("anvil: checkpoints every %lld steps to %s\n", static_cast<long long>(cfg.checkpoint.interval),
                folder.c_str());
  }
  std::printf("anvil: training to step %lld; metrics to %s; Ctrl-C stops cleanly\n", static_cast<long long>(tc.steps),
              metrics.path().c_str());

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
  for (int64_t step = first_step; step <= tc.steps; ++step) {
    const auto t_fetch = Clock::now();
    int64_t step_tokens = 0;
    for (int64_t i = 0; i < accum_steps; ++i) {
      ANVIL_CHECK(loader.next_batch(tokens[static_cast<size_t>(i)], targets[static_cast<size_t>(i)]),
                  "the dataset ran out of tokens");
      step_tokens += tokens[static_cast<size_t>(i)].numel();  // packed windows never ignore a target
    }
    data_seconds += seconds_since(t_fetch);

    ps.zero_grad();
    double loss_sum = 0;
    int64_t loss_tokens = 0;
    for (int64_t i = 0; i < accum_steps; ++i) {
      const CrossEntropyResult r = model.forward_backward(tokens[static_cast<size_t>(i)], targets[static_cast<size_t>(i)],
                                                          1.0f / static_cast<float>(step_tokens), ac);
      loss_sum += r.loss_sum;
      loss_tokens += r.num_tokens;
      if (g_interrupted) break;
    }
    if (g_interrupted) {
      std::printf("anvil: interrupted during step %lld; its gradients were discarded. %lld steps completed.\n",
                  static_cast<long long>(step), static_cast<long long>(step - 1));
      result.interrupted = true;
      break;
    }
    const double loss = loss_sum / static_cast<double>(loss_tokens);
    const Tensor grads[] = {ps.grad_flat()};
    const double grad_norm = grad_norm_from_sum_of_squares(grad_sum_of_squares(grads));
    const double lr = schedule.at(step);
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
    Tensor* compute_copy = dt == DType::bf16 ? &ps.compute_flat() : nullptr;
    adamw_step(adamw, step, ps.master_flat(), ps.grad_flat(), adam_m, adam_v, compute_copy, clip);

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
      log.tokens_per_s = static_cast<double>(interval_tokens) / secs;
      log.tflops = fpt * log.tokens_per_s / 1e12;
      log.mfu_pct = 100.0 * fpt * log.tokens_per_s / peak.flops_per_s;
      log.memory = alloc.stats();
      log.data_pct = 100.0 * data_seconds / secs;
      log.elapsed_s = seconds_since(t_start);
      metrics.log(log);
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
      val_loader->set_state(StreamState{});  // the same held-out batches every time
      std::printf("step %5lld | validation loss %.4f over %lld tokens\n", static_cast<long long>(step),
                  vsum / static_cast<double>(vtok), static_cast<long long>(vtok));
    }
    if (checkpointer && (step % cfg.checkpoint.interval == 0 || step == tc.steps)) {
      const auto t_save = Clock::now();
      const size_t bytes = checkpointer->save(step, ps, adam_m, adam_v, loader.state_json(),
                                              detail::concat(args.name, "/", args.flavor));
      std::printf("anvil: checkpoint %s saved (%s, %.2fs)\n", checkpointer->path_of(step).c_str(),
                  human_bytes(bytes).c_str(), seconds_since(t_save));
    }
    if (g_interrupted) {
      std::printf("anvil: interrupted after step %lld of %lld.\n", static_cast<long long>(step),
                  static_cast<long long>(tc.steps));
      result.interrupted = true;
      break;
    }
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
