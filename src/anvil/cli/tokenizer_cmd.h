// `anvil tokenizer encode|decode`: check any text against a tokenizer from the
// shell. Text and ids travel on standard input and output.
#pragma once
#include <string>
#include <vector>

namespace anvil {

// args are the words after `tokenizer`. Returns the exit code: 0 on success,
// 1 for bad input or a tokenizer that fails to load, 2 for a usage error.
int tokenizer_command(const std::vector<std::string>& args);

}  // namespace anvil
