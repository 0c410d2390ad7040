// Checkpoints: everything a run needs to continue exactly — fp32 master
// weights, the optimizer's state (AdamW's moments, Muon's momentum), the step,
// the data loader's position, the RNG state and the configuration — in a
// folder per step, written atomically:
//   <folder>/step-<N>.tmp/ is filled and fsynced, then renamed to step-<N>/,
// so a crash mid-save leaves the previous checkpoint as it was. Tensors are
// stored by Hugging Face parameter name with their global shape (safetensors),
// so a later parallel layout can load them; every file's CRC32 is checked on load.
#pragma once
#include <cmath>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "anvil/core/tensor.h"
#include "anvil/model/params.h"

namespace anvil {

struct CheckpointMeta {
  nlohmann::json loader;    // the data loader's position
  nlohmann::json rng;       // the run's random state
  std::string config_toml;  // the whole job configuration
  std::string model;        // "llama3/debugmodel"
  nlohmann::json model_state;  // what the model keeps but does not train (a MoE's expert biases); null: none
  double loss = std::nan("");  // the saved step's training loss, for the resumed run's summary (NaN: none)
};

// The optimizer whose state a checkpoint holds: its name (state.json's
// "optimizer"; a resume under another is refused), and which parameters keep
// Muon's one momentum_buffer (from the first state buffer) in place of AdamW's
// exp_avg and exp_avg_sq. By name, so it holds for global tensors.
struct CheckpointOptimizer {
  std::string name = "AdamW";
  std::function<bool(const std::string&)> momentum_only;  // empty: none
  bool is_momentum(const std::string& param) const { return momentum_only && momentum_only(param); }
};

class Checkpointer {
 public:
  // keep_latest_k: how many checkpoints to keep (0: all). async: save() copies
  // the state and a background thread writes it while training goes on.
  Checkpointer(std::string folder, int64_t keep_latest_k, bool async = false);
  ~Checkpointer();  // finishes a pending background save (errors are printed)

  // Saves step `step`: the model, and unless adam_m is null the optimizer
  // state. A model-only save stores the weights in `model_dtype` and cannot be
  // resumed from. Waits for the previous background save first and rethrows
  // its error. A failed write removes the unfinished folder and throws
  // anvil::Error; earlier checkpoints are untouched.
  // `optimizer` says what the two state buffers hold for each parameter.
  void save(int64_t step, const ParamStore& params, const Tensor* adam_m, const Tensor* adam_v,
            const CheckpointMeta& meta, DType model_dtype = DType::f32, const CheckpointOptimizer& optimizer = {});
  // The same from flat buffers laid out as `specs` say (a sharded run's gathered state).
  void save(int64_t step, const std::vector<ParamSpec>& specs, const Tensor& master_flat, const Tensor* adam_m,
            const Tensor* adam_v, const CheckpointMeta& meta, DType model_dtype = DType::f32,
            const CheckpointOptimizer& optimizer = {});
  // Waits for a background save; rethrows its error.
  void wait();

  // The newest complete resumable checkpoint's step, or -1 when there is none.
  int64_t latest_step() const;
  std::string path_of(int64_t step) const;
  const std::string& folder() const { return folder_; }

  // Loads step `step` into the master weights (and their compute copy) and the
  // optimizer state; returns the saved state.json. Throws anvil::Error naming
  // the file and the reason (checksum, missing file, mismatching tensor shape,
  // a checkpoint of another optimizer than `optimizer`).
  nlohmann::json load(int64_t step, ParamStore& params, Tensor& adam_m, Tensor& adam_v,
                      const CheckpointOptimizer& optimizer = {}) const;
  // The same into flat buffers laid out as `specs` say.
  nlohmann::json load(int64_t step, const std::vector<ParamSpec>& specs, const Tensor& master_flat,
                      const Tensor& adam_m, const Tensor& adam_v, const CheckpointOptimizer& optimizer = {}) const;

 private:
  struct Pending;  // a save's copied state
  void write(Pending& p);
  // The step's files into `dir` — weights, optimizer state, config, and
  // state.json with their CRC32s — each fsynced; `progress` sees the bytes.
  void write_files(const Pending& p, const std::filesystem::path& dir,
                   const std::function<void(size_t, size_t)>& progress) const;
  // Drops the oldest complete checkpoints beyond checkpoint.keep_latest_k.
  void drop_oldest() const;
  std::string folder_;
  int64_t keep_latest_k_;
  bool async_;
  std::thread writer_;
  std::exception_ptr writer_error_;
  // An asynchronous save's copy, held until the next wait() — the next save
  // or the run's end — however soon the writer is done with it, so what a run
  // holds does not depend on how fast the disk is (and a dry run, which
  // writes nothing, holds it the same).
  std::shared_ptr<Pending> held_;
};

// The model weights of an Anvil checkpoint folder (step-N, full or model-only),
// checksums verified, into the master weights and their compute copy.
void load_checkpoint_model(const std::string& step_dir, ParamStore& params);

// A step folder's state.json and weights (as f32, by Hugging Face name), the
// files checked against the CRC32s state.json recorded. For exports; reads
// full and model-only checkpoints alike. Throws anvil::Error naming the file.
struct CheckpointWeights {
  nlohmann::json state;
  std::map<std::string, Tensor> tensors;
};
CheckpointWeights load_checkpoint_weights(const std::string& step_dir);
// The model a checkpoint holds, "<name>/<flavor>" ("" when unknown).
std::string checkpoint_model(const nlohmann::json& state);

// Writes <folder>/step-<step>/ with model.safetensors and a state.json marked
// "model_only" (plus the fields of `extra`): weights without optimizer moments
// or a data position, as `anvil convert import` makes them. Atomic like
// Checkpointer::save; refuses to replace an existing step folder. Returns the
// bytes written. `model` is "<name>/<flavor>".
size_t save_model_only_checkpoint(const std::string& folder, int64_t step,
                                  const std::vector<std::pair<std::string, Tensor>>& weights,
                                  const std::string& model, const nlohmann::json& extra = {});

}  // namespace anvil
