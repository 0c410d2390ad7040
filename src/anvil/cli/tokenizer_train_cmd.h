// `anvil tokenizer train`: learn a byte-level BPE vocabulary from text files
// (or the Brown corpus) and write it as a Hugging Face tokenizer.json.
#pragma once
#include <string>
#include <vector>

namespace anvil {

// `args` are the words after `tokenizer train`. Returns the exit code:
// 0 on success, 1 on bad input (the message is printed on stderr), 2 on bad usage.
int tokenizer_train_command(const std::vector<std::string>& args);

}  // namespace anvil
