// `anvil convert`: Hugging Face interop (model/hf_format.h does the work), for
// Llama, Qwen3 and Qwen3-MoE.
//   anvil convert export CHECKPOINT OUT_DIR [--dtype float32|bfloat16] [--tokenizer PATH] [--section.key value ...]
//     a transformers folder from a checkpoint's master weights; CHECKPOINT is
//     any form `anvil generate` reads (train/model_source.h); the model comes
//     from the checkpoint's state.json.
//   anvil convert import HF_DIR OUT_DIR [--model.name N --model.flavor F]
//     a Hugging Face folder, its flavour the one config.json matches (or the
//     one named, checked against it), as a model-only checkpoint
//     OUT_DIR/step-0/ (f32 master weights; no optimizer state or data
//     position, so it is a starting point, not a run to resume).
#pragma once
#include <string>
#include <vector>

namespace anvil {

// The words after `anvil convert`; returns the exit code. Bad usage and bad
// input throw anvil::Error.
int convert_command(const std::vector<std::string>& args);

}  // namespace anvil
