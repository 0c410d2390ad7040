// Activation checkpointing policies, as torchtitan's [activation_checkpoint]:
//   none            every block keeps all it needs for backward
//   selective_layer every k-th block (layers 0, k, 2k, ...) keeps only its input
//                   and recomputes its forward during backward
//   selective_op    every block keeps the outputs of its matrix products and of
//                   attention, and recomputes the cheap element-wise ops and norms
//   full            every block keeps only its input
// Each transformer block applies the policy to its own saved record
// (transformer_block.h), by its layer number in the whole model, so a
// pipeline stage keeps what the same layers keep in a single process.
#pragma once
#include <cstdint>

namespace anvil {

enum class AcMode { none, selective_layer, selective_op, full };
struct AcPolicy {
  AcMode mode = AcMode::none;
  int every = 2;  // selective_layer's k
  // Whether block `layer` keeps only its input and recomputes all of its forward.
  bool recomputes_whole_block(int64_t layer) const {
    return mode == AcMode::full || (mode == AcMode::selective_layer && layer % every == 0);
  }
};
const char* ac_mode_name(AcMode m);

}  // namespace anvil
