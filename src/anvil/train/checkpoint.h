// Checkpoints: everything a run needs to continue exactly — fp32 master
// weights, AdamW's moments, the step, the data loader's position and the
// configuration — in a folder per step, written atomically:
//   <folder>/step-<N>.tmp/ is filled and fsynced, then renamed to step-<N>/,
// so a crash mid-save leaves the previous checkpoint as it was. Tensors are
// stored by Hugging Face parameter name with their global shape (safetensors),
// so a later parallel layout can load them; every file's CRC32 is checked on load.
#pragma once
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "anvil/core/tensor.h"
#include "anvil/model/params.h"

namespace anvil {

class Checkpointer {
 public:
  // keep_latest_k: how many checkpoints to keep (0: all).
  Checkpointer(std::string folder, int64_t keep_latest_k);

  // Saves step `step`; returns the bytes written.
  size_t save(int64_t step, const ParamStore& params, const Tensor& adam_m, const Tensor& adam_v,
              const nlohmann::json& loader_state, const std::string& config_summary);

  // The newest complete checkpoint's step, or -1 when there is none.
  int64_t latest_step() const;
  std::string path_of(int64_t step) const;

  // Loads step `step` into the master weights (and their compute copy) and the
  // AdamW moments; returns the saved loader state. Throws anvil::Error naming
  // the file and the reason (checksum, missing file, mismatching tensor shape).
  nlohmann::json load(int64_t step, ParamStore& params, Tensor& adam_m, Tensor& adam_v) const;

 private:
  std::string folder_;
  int64_t keep_latest_k_;
};

// A step folder's state.json and master weights (f32, by Hugging Face name),
// the weights file checked against the CRC32 state.json recorded. For exports
// and for starting a run from a checkpoint's weights; reads full and
// model-only checkpoints alike. Throws anvil::Error naming the file.
struct CheckpointWeights {
  nlohmann::json state;
  std::map<std::string, Tensor> tensors;
};
CheckpointWeights load_checkpoint_weights(const std::string& step_dir);

// Writes <folder>/step-<step>/ with model.safetensors and a state.json marked
// "model_only" (plus the fields of `extra`): weights without optimizer moments
// or a data position, as `anvil convert import` makes them. Atomic like
// Checkpointer::save; refuses to replace an existing step folder. Returns the
// bytes written. Checkpointer::load refuses such a checkpoint, since there is
// no run to resume. config_summary is "<model name>/<flavor>", as
// Checkpointer::save's caller records it.
size_t save_model_only_checkpoint(const std::string& folder, int64_t step,
                                  const std::vector<std::pair<std::string, Tensor>>& weights,
                                  const std::string& config_summary, const nlohmann::json& extra = {});

}  // namespace anvil
