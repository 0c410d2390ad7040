// Where a model's weights come from outside the run that made them: an Anvil
// checkpoint step folder (step-N, holding state.json), a checkpoint folder
// (its newest complete step), a job's dump folder (its checkpoint folder's
// newest step), or a Hugging Face Llama, Qwen3 or Qwen3-MoE folder
// (config.json and model.safetensors). Training's
// checkpoint.initial_load_path, `anvil generate` and `anvil convert` read
// them the same way.
#pragma once
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "anvil/data/tokenizer.h"
#include "anvil/model/args.h"
#include "anvil/model/llama.h"
#include "anvil/model/params.h"

namespace anvil {

struct ModelSource {
  enum class Kind { anvil_checkpoint, hugging_face };
  Kind kind = Kind::anvil_checkpoint;
  std::string path;         // the step folder, or the Hugging Face folder
  ModelArgs args;           // the model it holds
  std::string config_toml;  // an Anvil checkpoint's job configuration ("" for Hugging Face)
  nlohmann::json model_state;  // an Anvil checkpoint's untrained model state (state.json's model_state), or null
};

// What a model keeps but does not train, as checkpoints store it: a MoE's
// expert biases ({"expert_bias": (n_layers·E)}) under the auxiliary-loss-free
// balance, else null; and back into a model built from the same args.
nlohmann::json model_state_of(Llama& model);
void apply_model_state(const nlohmann::json& state, Llama& model);

// Resolves `path`. An Anvil checkpoint names its model in state.json; for a
// Hugging Face folder `flavor` ("llama3/8B") names it, or, when empty, the
// one flavour whose shapes config.json matches. Throws anvil::Error saying
// what the folder lacks (no state.json, no config.json, no step-N inside, no
// matching flavour).
ModelSource find_model_source(const std::string& path, const std::string& flavor = "");

// A command's SOURCE word (`anvil generate`, `anvil convert export`) as the
// path find_model_source reads: a job's CONFIG.toml, with its --section.key
// `overrides`, stands for the checkpoint folder that job saves to
// (<job.dump_folder>/<checkpoint.folder>); any other word for itself. Throws
// anvil::Error when that job has saved no checkpoint yet, or when overrides
// come without a CONFIG.toml.
std::string model_source_path(const std::string& source, const std::vector<std::string>& overrides);

// The source's weights into the master weights and their compute copy,
// checksums (Anvil) and shapes (both) checked.
void load_model_weights(const ModelSource& source, ParamStore& params);
// A source that must hold `args`' model (training's initial_load_path):
// find_model_source, then the model checked, then the weights.
void load_model_weights(const std::string& path, const ModelArgs& args, ParamStore& params);

// The tokenizer the model was trained with: `override_path` when given, else
// an Anvil checkpoint's job tokenizer (model.tokenizer_path of its saved
// configuration) or a Hugging Face folder's tokenizer.json; checked against
// the model's vocabulary. Throws anvil::Error naming the file and suggesting
// --tokenizer when it is missing.
std::unique_ptr<Tokenizer> model_source_tokenizer(const ModelSource& source, const std::string& override_path = "");

}  // namespace anvil
