// The `anvil` program: train | estimate | tokenizer | tokenize | report | plan | calibrate |
// pipeline-schedule | generate | convert | config-docs | info; help and --version.
#include <algorithm>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "anvil/cli/convert_cmd.h"
#include "anvil/cli/estimate_cmd.h"
#include "anvil/cli/generate_cmd.h"
#include "anvil/cli/pipeline_schedule_cmd.h"
#include "anvil/cli/plan_cmd.h"
#include "anvil/cli/report_cmd.h"
#include "anvil/cli/tokenize_cmd.h"
#include "anvil/cli/tokenizer_cmd.h"
#include "anvil/cli/tokenizer_train_cmd.h"
#include "anvil/cli/version.h"
#include "anvil/core/cpu_peak.h"
#include "anvil/core/did_you_mean.h"
#include "anvil/core/error.h"
#include "anvil/core/parallel_for.h"
#ifdef ANVIL_CUDA
#include "anvil/cuda/device.h"
#include "anvil/ops/cuda/device_runtime.h"
#endif
#include "anvil/distributed/deadline.h"
#include "anvil/distributed/mesh.h"
#include "anvil/estimate/flops.h"
#include "anvil/estimate/memory.h"
#include "anvil/model/llama.h"
#include "anvil/ops/matmul.h"
#include "anvil/train/config.h"
#include "anvil/train/parallel_dims.h"
#include "anvil/train/trainer.h"

namespace {

void usage(FILE* out) {
  std::fprintf(
      out,
      "usage: anvil <command> [options]\n\n"
      "commands:\n"
      "  train [CONFIG.toml] [--section.key value ...]   train a model (anvil train --help lists every key)\n"
      "  estimate [CONFIG.toml] [--section.key value ...] every rank's predicted peak memory, and whether it fits\n"
      "  tokenizer encode --tokenizer PATH               UTF-8 text on stdin -> token ids on stdout\n"
      "  tokenizer decode --tokenizer PATH               token ids on stdin -> UTF-8 text on stdout\n"
      "  tokenizer train --vocab-size N --output PATH    train a byte-level BPE tokenizer\n"
      "  tokenize --input PATH... --output-dir DIR       text or JSON Lines (.gz) -> token shards\n"
      "  report DUMP_FOLDER [--output PATH]              one HTML page of a run: loss, throughput, memory\n"
      "  plan CONFIG.toml --hardware H --gpus N          GPU layouts that fit, ranked by predicted tokens/s\n"
      "  calibrate CONFIG.toml --hardware H --gpus N --shapes FILE\n"
      "                                                  the shapes a GPU calibration file should time\n"
      "  pipeline-schedule --schedule NAME --ranks P --micro-batches M\n"
      "                                                  a pipeline schedule's actions, in-flight counts, bubble\n"
      "  generate SOURCE --prompt TEXT [--prompt ...]    text from a checkpoint or Hugging Face folder\n"
      "  convert export CHECKPOINT OUT_DIR [--dtype D]   checkpoint -> Hugging Face Llama, Qwen3 or Qwen3-MoE folder\n"
      "  convert import HF_DIR OUT_DIR                   Hugging Face Llama, Qwen3 or Qwen3-MoE folder -> checkpoint\n"
      "  config-docs                                     the configuration reference as Markdown\n"
      "  info                                            version, threads, matmul kernels, peak FLOP/s, CUDA\n\n"
      "anvil <command> --help: the command's options and examples. anvil --version: the version and git commit.\n");
}

constexpr const char* kTrainUsage =
    "usage: anvil train [CONFIG.toml | --job.config_file CONFIG.toml] [--section.key value ...]\n"
    "  Trains the configured model: one process, or one rank per process under mpirun or srun. Flags override\n"
    "  the file's keys (listed below); the run first checks that its predicted memory fits (anvil estimate).\n\n"
    "examples:\n"
    "  anvil train configs/debugmodel.toml\n"
    "  anvil train configs/debugmodel.toml --training.steps 20 --checkpoint.enable\n"
    "  mpirun -np 4 anvil train configs/debugmodel.toml --parallelism.data_parallel_shard_degree 4\n\n";

constexpr const char* kConfigDocsUsage =
    "usage: anvil config-docs\n"
    "  Prints the configuration reference, every key with its type, default and meaning, as Markdown\n"
    "  (docs/configuration.md embeds it).\n\n"
    "example:\n"
    "  anvil config-docs > keys.md\n";

constexpr const char* kInfoUsage =
    "usage: anvil info\n"
    "  Prints the version and git commit, the OpenMP threads, the matrix-product kernels chosen for this CPU,\n"
    "  its measured peak FLOP/s and, in a CUDA build, the GPUs and CUDA libraries.\n\n"
    "examples:\n"
    "  anvil info\n"
    "  OMP_NUM_THREADS=4 anvil info\n";

bool wants_help(const std::vector<std::string>& args) {
  for (const auto& a : args)
    if (a == "--help" || a == "-h") return true;
  return false;
}

// "anvil 0.1.0 (commit 13beed5d4c26)".
std::string version_line() {
  return std::string("anvil ") + anvil::version() + " (commit " + anvil::git_commit() + ")";
}

int train_command(const std::vector<std::string>& rest, int argc, char** argv) {
  if (wants_help(rest)) {
    std::printf("%s%s", kTrainUsage, anvil::config_help().c_str());
    return 0;
  }
  const anvil::JobConfig cfg = anvil::parse_config(rest);
  // Under mpirun or srun every rank runs this; a single process needs no MPI.
  std::unique_ptr<anvil::MpiRuntime> mpi;
  if (anvil::launched_by_mpi_launcher()) {
    // MPI's own start waits for every rank: it has the start-up deadline too.
    anvil::set_comm_deadline(static_cast<double>(cfg.comm.init_timeout_seconds), "comm.init_timeout_seconds");
    mpi = std::make_unique<anvil::MpiRuntime>(argc, argv);
  }
  try {
    const anvil::TrainResult r = anvil::train(cfg);
    return r.interrupted ? 130 : 0;
  } catch (const std::exception& e) {
    // The other ranks would wait for this one in their next collective:
    // stop the whole job, naming this rank.
    if (mpi && anvil::Communicator::world().size() > 1) anvil::abort_all(std::string("error: ") + e.what());
    throw;
  }
}

int tokenizer_family(const std::vector<std::string>& rest) {
  if (!rest.empty() && rest[0] == "train")
    return anvil::tokenizer_train_command(std::vector<std::string>(rest.begin() + 1, rest.end()));
  return anvil::tokenizer_command(rest);
}

int config_docs_command(const std::vector<std::string>& rest) {
  if (wants_help(rest)) {
    std::printf("%s", kConfigDocsUsage);
    return 0;
  }
  std::printf("%s", anvil::config_markdown().c_str());
  return 0;
}

int info_command(const std::vector<std::string>& rest) {
  if (wants_help(rest)) {
    std::printf("%s", kInfoUsage);
    return 0;
  }
  std::printf("%s\n", version_line().c_str());
  std::printf("threads: %d\n", anvil::num_threads());
  std::printf("bf16 matmul kernel: %s\n", anvil::matmul_impl_name(anvil::DType::bf16).c_str());
  std::printf("f32 matmul kernel:  %s\n", anvil::matmul_impl_name(anvil::DType::f32).c_str());
  std::printf("%s", anvil::cpu_peak_report(anvil::num_threads()).c_str());
#ifdef ANVIL_CUDA
  std::printf("%s", anvil::cuda_report().c_str());
#else
  std::printf("CUDA: not in this build (configure with -DANVIL_CUDA=ON where nvcc is installed)\n");
#endif
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // A line at a time: stdout and stderr keep their order when both go to one file or pipe.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  if (argc < 2) {  // as git and cargo do: the usage, on stderr, and a usage error's exit code
    usage(stderr);
    return 2;
  }
#ifdef ANVIL_CUDA
  anvil::warn_if_cudnn_is_older();   // before anything runs; needs no GPU
  anvil::register_cuda_runtime();  // core reaches a GPU through it (core/device.h); touches no GPU yet
#endif
  try {
    const std::string cmd = argv[1];
    const std::vector<std::string> rest(argv + 2, argv + argc);
    if (cmd == "help" || cmd == "--help" || cmd == "-h") {
      usage(stdout);
      return 0;
    }
    if (cmd == "--version") {
      std::printf("%s\n", version_line().c_str());
      return 0;
    }
    using Run = std::function<int(const std::vector<std::string>&)>;
    const std::vector<std::pair<std::string, Run>> commands = {
        {"train", [&](const std::vector<std::string>& a) { return train_command(a, argc, argv); }},
        {"estimate", anvil::estimate_command},
        {"tokenizer", tokenizer_family},
        {"tokenize", anvil::tokenize_command},
        {"report", anvil::report_command},
        {"plan", anvil::plan_command},
        {"calibrate", anvil::calibrate_command},
        {"pipeline-schedule", anvil::pipeline_schedule_command},
        {"generate", anvil::generate_command},
        {"convert", anvil::convert_command},
        {"config-docs", config_docs_command},
        {"info", info_command},
    };
    std::vector<std::string> names;
    for (const auto& [name, run] : commands) {
      if (name == cmd) return run(rest);
      names.push_back(name);
    }
    // A slip of two letters ("trian") is a typo; anything further is not worth guessing at.
    const std::string guess = anvil::nearest_word(names, cmd, std::max<size_t>(2, cmd.size() / 3));
    std::fprintf(stderr, "anvil: unknown command '%s'; %s\n", cmd.c_str(),
                 guess.empty() ? "run 'anvil help' for the list"
                               : ("did you mean '" + guess + "'? (anvil help lists the commands)").c_str());
    return 2;
  } catch (const anvil::Error& e) {
    std::fprintf(stderr, "anvil: error: %s\n", e.what());
    return 1;
  }
}
