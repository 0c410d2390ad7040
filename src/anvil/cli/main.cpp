// The `anvil` program. Subcommands grow with the trainer; for now it reports the
// engine's build and the kernels oneDNN selects on this CPU.
#include <cstdio>
#include <cstring>
#include <string>

#include "anvil/core/error.h"
#include "anvil/core/parallel.h"
#include "anvil/ops/matmul.h"

namespace {
void usage() {
  std::printf(
      "usage: anvil <command>\n\n"
      "commands:\n"
      "  info     print threads and the matrix-product kernels oneDNN picks on this CPU\n"
      "  help     this message\n");
}
}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string cmd = argc > 1 ? argv[1] : "help";
    if (cmd == "help" || cmd == "--help" || cmd == "-h") {
      usage();
      return 0;
    }
    if (cmd == "info") {
      std::printf("threads: %d\n", anvil::num_threads());
      std::printf("bf16 matmul kernel: %s\n", anvil::matmul_impl_name(anvil::DType::bf16).c_str());
      std::printf("f32 matmul kernel:  %s\n", anvil::matmul_impl_name(anvil::DType::f32).c_str());
      return 0;
    }
    std::fprintf(stderr, "anvil: unknown command '%s'; run 'anvil help' for the list\n", cmd.c_str());
    return 2;
  } catch (const anvil::Error& e) {
    std::fprintf(stderr, "anvil: error: %s\n", e.what());
    return 1;
  }
}
