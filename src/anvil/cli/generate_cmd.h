// `anvil generate`: text from a trained model (generate/generator.h does the work).
//   anvil generate SOURCE --prompt TEXT [--prompt TEXT ...] [--max_new_tokens N] [--temperature T]
//                  [--top_k K] [--top_p P] [--seed S] [--dtype bf16|fp32] [--tokenizer PATH]
//                  [--model NAME/FLAVOR]
// SOURCE: an Anvil checkpoint (a step-N folder, or the checkpoint folder: its
// newest step), a Hugging Face Llama folder, or a job's CONFIG.toml (with any
// --section.key overrides): the newest checkpoint that job saved.
#pragma once
#include <string>
#include <vector>

namespace anvil {

// The words after `anvil generate`; returns the exit code. Bad usage and bad
// input throw anvil::Error.
int generate_command(const std::vector<std::string>& args);

// The longest prefix of `text` that does not end inside a UTF-8 sequence:
// what can be printed of a stream of tokens before the next one arrives.
size_t complete_utf8_prefix(const std::string& text);

}  // namespace anvil
