// The `anvil` program: train | estimate | tokenizer | tokenize | report | plan | pipeline-schedule |
// generate | convert | config-docs | info.
#include <cstdio>
#include <cstring>
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
#include "anvil/core/cpu_peak.h"
#include "anvil/core/error.h"
#include "anvil/core/parallel_for.h"
#ifdef ANVIL_CUDA
#include "anvil/cuda/device.h"
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

void usage() {
  std::printf(
      "usage: anvil <command> [options]\n\n"
      "commands:\n"
      "  train [CONFIG.toml] [--section.key value ...]   train a model (anvil train --help lists every key)\n"
      "  estimate [CONFIG.toml] [--section.key value ...] every rank's predicted peak memory per category (--help)\n"
      "  tokenizer encode|decode --tokenizer PATH        UTF-8 text on stdin -> ids on stdout, or back\n"
      "  tokenizer train --vocab-size N --output PATH    train a byte-level BPE tokenizer (--help for inputs)\n"
      "  tokenize --input PATH... --output-dir DIR       text or JSON Lines (.gz) -> token shards (--help)\n"
      "  report DUMP_FOLDER [--output PATH]              one HTML page of a run: loss, throughput, memory (--help)\n"
      "  plan CONFIG.toml --hardware H --gpus N          GPU layouts that fit, ranked by predicted tokens/s (--help)\n"
      "  calibrate CONFIG.toml --hardware H --gpus N --shapes FILE\n"
      "                                                  the shapes a GPU calibration file should time (--help)\n"
      "  pipeline-schedule --schedule NAME --ranks P --micro-batches M\n"
      "                                                  a pipeline schedule's actions, in-flight counts, bubble "
      "(--help)\n"
      "  generate SOURCE --prompt TEXT [--prompt ...]    text from a checkpoint or Hugging Face folder (--help)\n"
      "  convert export STEP_DIR OUT_DIR [--dtype D]     checkpoint -> Hugging Face Llama folder (--help)\n"
      "  convert import HF_DIR OUT_DIR --model.flavor F  Hugging Face Llama folder -> model-only checkpoint\n"
      "  config-docs                                     the configuration reference as Markdown\n"
      "  info                                            threads, matrix-product kernels, peak FLOP/s, CUDA\n");
}

bool wants_help(const std::vector<std::string>& args) {
  for (const auto& a : args)
    if (a == "--help" || a == "-h") return true;
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  // A line at a time: stdout and stderr keep their order when both go to one file or pipe.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  try {
    const std::string cmd = argc > 1 ? argv[1] : "help";
    const std::vector<std::string> rest(argv + std::min(argc, 2), argv + argc);
    if (cmd == "help" || cmd == "--help" || cmd == "-h") {
      usage();
      return 0;
    }
    if (cmd == "estimate" && !wants_help(rest)) return anvil::estimate_command(rest);
    if (cmd == "train" || cmd == "estimate") {
      if (wants_help(rest)) {
        if (cmd == "estimate")
          std::printf("anvil estimate CONFIG.toml [--section.key value ...] [--ranks N] [--json]\n"
                      "  every rank's predicted peak memory per category under the configured layout, FLOPs per\n"
                      "  token and communication per step; --ranks: the world size (default: the product of the\n"
                      "  degrees, data_parallel_shard_degree -1 counting as 1)\n"
                      "anvil estimate CONFIG.toml --hardware H --gpus N [--json] [--calibration FILE]\n"
                      "  the GPU-cluster planner's per-GPU memory, step time, tokens/s and MFU; --calibration:\n"
                      "  rates measured on your GPU (anvil calibrate --help)\n\n"
                      "configuration keys:\n");
        std::printf("%s", anvil::config_help().c_str());
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
    if (cmd == "tokenizer") {
      if (!rest.empty() && rest[0] == "train")
        return anvil::tokenizer_train_command(std::vector<std::string>(rest.begin() + 1, rest.end()));
      return anvil::tokenizer_command(rest);
    }
    if (cmd == "tokenize") return anvil::tokenize_command(rest);
    if (cmd == "report") return anvil::report_command(rest);
    if (cmd == "plan") return anvil::plan_command(rest);
    if (cmd == "calibrate") return anvil::calibrate_command(rest);
    if (cmd == "pipeline-schedule") return anvil::pipeline_schedule_command(rest);
    if (cmd == "convert") return anvil::convert_command(rest);
    if (cmd == "generate") return anvil::generate_command(rest);
    if (cmd == "config-docs") {
      std::printf("%s", anvil::config_markdown().c_str());
      return 0;
    }
    if (cmd == "info") {
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
    std::fprintf(stderr, "anvil: unknown command '%s'; run 'anvil help' for the list\n", cmd.c_str());
    return 2;
  } catch (const anvil::Error& e) {
    std::fprintf(stderr, "anvil: error: %s\n", e.what());
    return 1;
  }
}
