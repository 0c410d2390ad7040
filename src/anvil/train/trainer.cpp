#include "anvil/train/trainer.h"

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>

#include "anvil/core/error.h"
#include "anvil/core/op_timer.h"
#include "anvil/core/process_memory.h"
#include "anvil/core/profiler.h"
#include "anvil/distributed/clock_sync.h"
#include "anvil/distributed/comm.h"
#include "anvil/distributed/deadline.h"
#include "anvil/model/hf_format.h"
#include "anvil/model/llama.h"
#include "anvil/obs/op_table.h"
#include "anvil/ops/adamw.h"
#include "anvil/ops/grad_norm.h"
#include "anvil/train/checkpoint.h"
#include "anvil/train/checkpoint_folder.h"
#include "anvil/train/console.h"
#include "anvil/train/forward_backward.h"
#include "anvil/train/gpu_job.h"
#include "anvil/train/lr_schedule.h"
#include "anvil/train/model_source.h"
#include "anvil/train/parallel_dims.h"
#include "anvil/train/parallelize.h"
#include "anvil/train/preflight.h"
#include "anvil/train/profiling.h"
#include "anvil/train/step_logger.h"
#include "anvil/train/stop_signal.h"
#include "anvil/train/train_data.h"
#include "anvil/train/train_step.h"

namespace anvil {

namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

std::string model_description(const ModelArgs& args) { return detail::concat(args.name, "/", args.flavor); }

// The step a run resumes from, checked against the model the run trains
// before anything is allocated.
ResumePlan plan_run_resume(const JobConfig& cfg, const ModelArgs& args, const Checkpointer* checkpointer) {
  if (!checkpointer) return {};
  const ResumePlan plan = plan_resume(checkpointer->folder(), cfg.checkpoint.load_step, cfg.checkpoint.overwrite_newer);
  const std::string model_desc = model_description(args);
  ANVIL_CHECK(plan.model.empty() || plan.model == model_desc, "checkpoint ", checkpointer->path_of(plan.step),
              " holds a ", plan.model, " model but this run trains ", model_desc, " (model.name ", args.name,
              ", model.flavor ", args.flavor, "). To resume it, run with --model.name ",
              plan.model.substr(0, plan.model.find('/')), " --model.flavor ",
              plan.model.substr(plan.model.find('/') + 1), "; to train ", model_desc,
              ", give another --job.dump_folder (or --checkpoint.folder)");
  return plan;
}

// Resumes from the step plan_resume chose (the newest complete one, or
// checkpoint.load_step); failing that, starts from checkpoint.initial_load_path's
// weights. Newer step folders the user asked to step back past are moved
// aside (by rank 0) only once the load has succeeded. Returns the first step to run.
int64_t restore(const JobConfig& cfg, const ModelArgs& args, ParallelizedModel& layout,
                const Checkpointer* checkpointer, const ResumePlan& plan, bool rank0, StreamLoader& loader,
                double& resumed_loss) {
  int64_t first_step = 1;
  if (plan.step >= 0) {
    const auto t_load = Clock::now();
    const std::string path = checkpointer->path_of(plan.step);
    nlohmann::json state;
    try {
      state = layout.load_checkpoint(*checkpointer, plan.step);
    } catch (const OutOfMemoryError&) {
      throw;
    } catch (const Error& e) {
      throw Error(detail::concat("cannot resume from ", path, ": ", e.what(), ". Nothing was written. ",
                                 resume_remedy(checkpointer->folder(), plan.step)));
    }
    loader.load_state_json(state.at("loader"));
    if (state.contains("model_state")) layout.load_model_state(state.at("model_state"));
    first_step = plan.step + 1;
    const auto loss = state.find("loss");
    if (loss != state.end() && loss->is_number()) resumed_loss = loss->get<double>();
    char loss_text[48] = "";
    if (!std::isnan(resumed_loss)) std::snprintf(loss_text, sizeof loss_text, ", loss %.4f", resumed_loss);
    std::printf("anvil: resumed from %s (step %lld%s) in %.2fs\n", path.c_str(), static_cast<long long>(plan.step),
                loss_text, seconds_since(t_load));
  }
  if (rank0) set_aside(plan.set_aside);
  if (first_step == 1 && !cfg.checkpoint.initial_load_path.empty()) {
    const auto t_load = Clock::now();
    layout.load_global_weights([&](ParamStore& store) {
      try {
        load_model_weights(cfg.checkpoint.initial_load_path, args, store);
      } catch (const OutOfMemoryError&) {
        throw;
      } catch (const Error& e) {
        throw Error(detail::concat("checkpoint.initial_load_path: ", e.what()));
      }
    });
    std::printf("anvil: model weights from %s (%.2fs); optimizer, step and data start afresh\n",
                cfg.checkpoint.initial_load_path.c_str(), seconds_since(t_load));
  }
  return first_step;
}

// Where everything goes, before the first step.
void print_destinations(const JobConfig& cfg, const StepLogger& logger, const Checkpointer* checkpointer,
                        int64_t first_step) {
  logger.print_destinations();
  if (checkpointer)
    std::printf("anvil: checkpoints every %lld steps to %s%s\n", static_cast<long long>(cfg.checkpoint.interval),
                checkpointer->folder().c_str(), cfg.checkpoint.async_mode == "async" ? " (written in the background)" : "");
  if (cfg.profiling.enable_profiling)
    std::printf("anvil: traces of step %lld and every %lld-th step to %s\n", static_cast<long long>(first_step),
                static_cast<long long>(cfg.profiling.profile_freq), trace_dir(cfg).c_str());
  if (cfg.profiling.enable_memory_snapshot || cfg.profiling.enable_profiling)
    std::printf("anvil: memory snapshots (at a profiled step's peak%s, or if memory runs out) to %s\n",
                cfg.profiling.enable_memory_snapshot ? "" : ": off", snapshot_dir(cfg).c_str());
}

// Test hooks, acting after the step's backward, before its gradients are
// reduced: ANVIL_FAULT_KILL_RANK=r:s makes rank r SIGKILL itself in step s (a
// rank that dies), ANVIL_FAULT_STALL_RANK=r:s makes it SIGSTOP itself there (a
// rank that hangs without dying: the others' deadlines must end the job).
// Returns this rank's step for `variable`, or -1.
int64_t fault_step(const char* variable, int rank) {
  const char* v = std::getenv(variable);
  int fault_rank = -1;
  long long step = -1;
  if (v && std::sscanf(v, "%d:%lld", &fault_rank, &step) == 2 && fault_rank == rank) return step;
  return -1;
}

// What a rank that gave up waiting for the others says of resuming.
std::string resume_hint(const Checkpointer* checkpointer) {
  if (!checkpointer) return "checkpoint.enable is off, so a relaunch starts afresh";
  const int64_t last = checkpointer->latest_step();
  if (last < 0) return "no checkpoint is complete yet, so a relaunch starts afresh";
  return "last complete checkpoint " + checkpointer->path_of(last) +
         "; to resume from it, run the same command again (it loads the newest complete checkpoint)";
}

// Deadlines on every wait for other ranks (distributed/deadline.h): the
// start-up one until the first step ends, then the training one; the
// expiry message names the step and the checkpoint to resume from.
class CommDeadlines {
 public:
  CommDeadlines(const JobConfig& cfg, const Checkpointer* checkpointer) : cfg_(cfg) {
    set_comm_deadline_step(0);
    set_comm_deadline_context([checkpointer] { return resume_hint(checkpointer); });
  }
  ~CommDeadlines() { set_comm_deadline_context({}); }
  void step_begins(int64_t step) { set_comm_deadline_step(step); }
  void first_step_done() {
    if (MpiRuntime::active())
      set_comm_deadline(static_cast<double>(cfg_.comm.train_timeout_seconds), "comm.train_timeout_seconds");
  }

 private:
  const JobConfig& cfg_;
};

void record_step(TrainResult& result, int64_t step, double loss) {
  if (result.steps_done < result.first_step) result.first_loss = loss;
  result.last_loss = loss;
  result.steps_done = step;
}

void validate_if_due(const JobConfig& cfg, int64_t step, TrainData& data, ParallelizedModel& layout,
                     const ParallelDims& par, StepLogger& logger) {
  if (!validation_due(cfg, step)) return;
  const auto [sum, tokens] = data.validation_loss(layout, par);
  logger.log_validation(step, sum / static_cast<double>(tokens), tokens);
}

// The stop agreed inside a step: its gradients are dropped.
void report_stop_in_step(int signal, const ParallelDims& par, int64_t step, int64_t micro_batches_done) {
  std::printf("anvil: interrupted (%s) during step %lld after micro-batch %lld of %lld; its gradients were "
              "discarded. %lld steps completed.\n",
              strsignal(signal), static_cast<long long>(step), static_cast<long long>(micro_batches_done),
              static_cast<long long>(par.accum_steps), static_cast<long long>(step - 1));
  if (par.distributed())
    std::fprintf(stderr, "anvil: rank %d: stopped in step %lld after micro-batch %lld of %lld\n", par.rank,
                 static_cast<long long>(step), static_cast<long long>(micro_batches_done),
                 static_cast<long long>(par.accum_steps));
}

void report_stop_after_step(int signal, const ParallelDims& par, int64_t step, int64_t steps) {
  std::printf("anvil: interrupted (%s) after step %lld of %lld.\n", strsignal(signal), static_cast<long long>(step),
              static_cast<long long>(steps));
  if (par.distributed())
    std::fprintf(stderr, "anvil: rank %d: stopped after step %lld\n", par.rank, static_cast<long long>(step));
}

// Op times on a GPU come from its stream's stamps (core/op_timer.h), for as
// long as the trainer runs there.
class OpClock {
 public:
  explicit OpClock(Device device) {
    if (!device.is_cpu()) OpTimer::set_device_clock(&device_runtime(device).clock());
  }
  ~OpClock() { OpTimer::set_device_clock(nullptr); }
  OpClock(const OpClock&) = delete;
  OpClock& operator=(const OpClock&) = delete;
};

// The per-op table of the steps after the first, on rank 0's console and in the dump folder.
void print_op_table(const JobConfig& cfg, const ParallelDims& par, OpTable& table) {
  if (!par.rank0()) return;
  if (table.steps == 0) {
    std::printf("anvil: op times: no step after the first (which builds the kernels) was timed; run 2 or more steps\n");
    return;
  }
  table.rows = OpTimer::rows();
  std::printf("anvil: time per op, the mean of %lld steps after the first (also op_times.md, op_times.json in %s):\n%s",
              static_cast<long long>(table.steps), cfg.job.dump_folder.c_str(), op_table_markdown(table).c_str());
  write_op_table(table, cfg.job.dump_folder);
}

}  // namespace

namespace {

// What the step loop works with, made by train().
struct TrainRun {
  const JobConfig& cfg;
  const ModelArgs& args;
  const ParallelDims& par;
  const RunBasis& mfu;
  StopSignals& stop;
  TrainData& data;
  ParallelizedModel& layout;
  StepLogger& logger;
  Checkpointer* checkpointer;
  CommDeadlines& deadlines;
  const StepContext& step_ctx;
  int64_t first_step;
  double resumed_loss;  // the resumed checkpoint's loss (NaN: none)
};

// The steps from first_step to training.steps, each followed by its log, the
// memory policy between steps, validation and checkpoint saves when due.
// `step` is the step running (an out-of-memory error names it).
TrainResult run_steps(const TrainRun& run, int64_t& step, OpTable& op_table) {
  const JobConfig& cfg = run.cfg;
  const ParallelDims& par = run.par;
  StepLogger& logger = run.logger;
  TrainResult result;
  result.first_step = run.first_step;
  result.resumed_loss = run.resumed_loss;
  // Training draws random numbers only to initialise the weights and order the
  // data, both from the seed; the loader's position carries the rest.
  const auto checkpoint_meta = [&] {
    return CheckpointMeta{run.data.loader().state_json(),
                          {{"seed", cfg.training.seed}, {"draws_after_init", 0}},
                          config_to_toml(cfg),
                          model_description(run.args),
                          run.layout.model_state(),
                          result.last_loss};
  };
  // Ends a timed step's op timing (validation and checkpoint saves are not the
  // step's) and adds its wall time to the table, so the ops sum to it.
  const auto end_op_timing = [&](Clock::time_point step_start) {
    if (!OpTimer::enabled()) return;
    OpTimer::set_enabled(false);
    op_table.step_seconds += seconds_since(step_start);
    ++op_table.steps;
  };
  for (; step <= cfg.training.steps; ++step) {
    run.deadlines.step_begins(step);
    std::unique_ptr<StepCapture> capture = capture_if_profiled(cfg, par, step, run.first_step);
    // Ops are timed from the second step on: the first makes every kernel and buffer.
    const auto t_step = Clock::now();
    OpTimer::set_enabled(cfg.profiling.op_times && step > run.first_step);
    std::optional<ScopedPhase> step_phase(std::in_place, SpanCategory::step, "step");
    const auto t_fetch = Clock::now();
    const int64_t step_tokens = run.data.next_step();
    logger.add_data_seconds(seconds_since(t_fetch));
    if (step == run.first_step && par.rank0())
      if (const std::string attention = run.data.attention_summary(); !attention.empty())
        std::printf("anvil: step %lld's %s\n", static_cast<long long>(step), attention.c_str());
    const StepOutcome out = log_allocations_of(
        cfg, par, step, [&] { return run_train_step(run.step_ctx, run.data.batches(), step_tokens, step); });
    logger.add_comm(out.comm);
    logger.add_moe(out.run.moe);
    if (out.end == StepOutcome::End::stopped) {
      end_op_timing(t_step);
      report_stop_in_step(run.stop.signal(), par, step, out.run.stopped_after);
      result.interrupted = true;
      break;
    }
    if (out.end == StepOutcome::End::skipped) {
      end_op_timing(t_step);
      continue;
    }
    logger.record_live_after_optimizer();
    step_phase.reset();
    end_op_timing(t_step);

    record_step(result, step, out.loss);
    logger.step_done(step, out.loss, out.grad_norm, out.lr, step_tokens);
    const bool one_off = validation_due(cfg, step) || checkpoint_due(cfg, step, run.checkpointer);
    release_after_step(run.layout, one_off);
    validate_if_due(cfg, step, run.data, run.layout, par, logger);
    save_checkpoint_if_due(cfg, step, run.layout, run.checkpointer, checkpoint_meta);
    release_after_one_off(one_off);
    finish_capture(capture, step);
    // Once the first step has made its kernels, buffers and trace.
    if (step == run.first_step) {
      logger.measure_untracked(step, run.mfu.predicted_peak_bytes);
      run.deadlines.first_step_done();
    }
    if (run.stop.requested(par)) {
      report_stop_after_step(run.stop.signal(), par, step, cfg.training.steps);
      result.interrupted = true;
      break;
    }
  }
  if (run.checkpointer) run.checkpointer->wait();  // a background save finishes before the run reports done
  write_run_peaks(cfg, par, logger.run_peaks(), logger.device(), logger.device_run_peaks());
  return result;
}

}  // namespace

TrainResult train(const JobConfig& cfg) {
  // Ctrl-C (or SIGTERM) from here on stops at the next micro-batch boundary,
  // with a message; under MPI every rank stops at the same one.
  StopSignals stop;
  // A write past a file-size limit (ulimit -f) fails with EFBIG and a message
  // instead of killing the process.
  std::signal(SIGXFSZ, SIG_IGN);
  Profiler::instance().set_thread_name("main");
  const auto& tc = cfg.training;
  ModelArgs args = job_model_args(cfg);
  args.validate();
  // Every wait for other ranks has a deadline, from the first collective on.
  if (MpiRuntime::active())
    set_comm_deadline(static_cast<double>(cfg.comm.init_timeout_seconds), "comm.init_timeout_seconds");
  // The layout first: every rank checks it, with the same message.
  const ParallelDims par = setup_parallel(cfg, args);
  // Where the job trains; what a GPU cannot run yet is refused here.
  std::string why_cpu;
  const Device device = job_device(cfg, &why_cpu);
  if (!why_cpu.empty() && par.rank0()) std::printf("anvil: job.device auto: training on the CPU: %s\n", why_cpu.c_str());
  if (!device.is_cpu()) check_gpu_job(args, par.world_size);
  // Which step to resume from, before anything is allocated or written: a
  // damaged newest checkpoint stops the run here.
  const std::unique_ptr<Checkpointer> checkpointer = make_checkpointer(cfg);
  const ResumePlan resume = plan_run_resume(cfg, args, checkpointer.get());
  // Rank 0 speaks for the job; the others write their own logs.
  route_rank_output(cfg, par);
  share_cores_between_local_ranks();
  if (par.distributed()) {
    std::printf("anvil: hosts: %s\n", hosts_summary().c_str());
    const std::string clocks = clock_offsets_summary();
    if (!clocks.empty())
      std::printf("anvil: clocks against rank 0's host, measured at start-up (traces use rank 0's clock): %s\n",
                  clocks.c_str());
  }
  const DType dt = compute_dtype(cfg);
  const AcPolicy ac = activation_checkpoint_policy(cfg);
  const std::unique_ptr<Tokenizer> tokenizer = load_job_tokenizer(cfg, args);
  // Refuses, before allocating anything, a run that cannot fit.
  const RunBasis mfu = check_fit_and_print_banner(cfg, args, par, dt, ac, device);
  // From here the model, its state and every step's tensors are made on the
  // job's device (the micro-batches are filled on the host and copied over).
  const ScopedDevice on_device(device);
  const OpClock op_clock(device);
  TrainData data(cfg, *tokenizer, par);

  ParallelizedModel layout(cfg, args, par, dt);
  layout.print_comm_closed_form();
  const LrSchedule lr = lr_schedule(cfg);
  // The checkpoint loads before the logs open, so a refused resume writes nothing.
  double resumed_loss = std::nan("");
  const int64_t first_step =
      restore(cfg, args, layout, checkpointer.get(), resume, par.rank0(), data.loader(), resumed_loss);
  StepLogger logger(cfg, par, mfu.peak, mfu.flops_per_token, layout.comm_bytes_closed_form());
  logger.set_optimizer_figures(layout.optimizer_flops_per_step(), layout.optimizer_bytes_per_step());
  CommDeadlines deadlines(cfg, checkpointer.get());
  print_destinations(cfg, logger, checkpointer.get(), first_step);
  if (first_step > tc.steps) {
    std::printf("anvil: the checkpoint already reached step %lld of training.steps %lld: nothing to train. Raise "
                "--training.steps, or give another --job.dump_folder to start afresh\n",
                static_cast<long long>(first_step - 1), static_cast<long long>(tc.steps));
    return TrainResult{};
  }
  std::printf("anvil: training to step %lld; Ctrl-C stops cleanly\n", static_cast<long long>(tc.steps));

  data.allocate_batches(par.accum_steps);
  const int64_t kill_step = fault_step("ANVIL_FAULT_KILL_RANK", par.rank);
  const int64_t stall_step = fault_step("ANVIL_FAULT_STALL_RANK", par.rank);
  release_caches();  // setup's one-off blocks
  logger.start();
  logger.measure_untracked(0, mfu.predicted_peak_bytes);
  int64_t step = first_step;
  const StepContext step_ctx{
      cfg, par, layout, ac, lr, ForwardBackwardHooks{{}, [&] { return stop.requested(par); }}, [&] {
        if (kill_step == step) std::raise(SIGKILL);   // test hooks: this rank dies mid-step,
        if (stall_step == step) std::raise(SIGSTOP);  // or hangs there
      }};
  OpTable op_table;
  OpTimer::reset();
  TrainResult result;
  try {
    result = run_steps(
        {cfg, args, par, mfu, stop, data, layout, logger, checkpointer.get(), deadlines, step_ctx, first_step,
         resumed_loss},
        step,
        op_table);
  } catch (const OutOfMemoryError& e) {
    rethrow_with_oom_snapshot(e, cfg, par, step);
  }
  OpTimer::set_enabled(false);  // a step that threw
  logger.print_done(result);
  if (cfg.profiling.op_times) print_op_table(cfg, par, op_table);
  return result;
}

}  // namespace anvil
