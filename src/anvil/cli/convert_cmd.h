// `anvil convert`: Hugging Face interop (model/hf_format.h does the work).
//   anvil convert export <checkpoint step folder> <out_dir> [--dtype float32|bfloat16] [--tokenizer PATH]
//     a transformers LlamaForCausalLM folder from a checkpoint's master weights;
//     the model comes from the checkpoint's state.json.
//   anvil convert import <hf_folder> <out folder> --model.flavor F [--model.name llama3]
//     a Hugging Face Llama folder, checked against the flavour, as a model-only
//     checkpoint <out folder>/step-0/ (f32 master weights; no optimizer state or
//     data position, so it is a starting point, not a run to resume).
#pragma once
#include <string>
#include <vector>

namespace anvil {

// The words after `anvil convert`; returns the exit code. Bad usage and bad
// input throw anvil::Error.
int convert_command(const std::vector<std::string>& args);

}  // namespace anvil
