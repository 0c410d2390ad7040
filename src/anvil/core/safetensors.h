// Reading and writing the safetensors format (Hugging Face's): an 8-byte
// little-endian header length, a JSON header naming each tensor's dtype, shape
// and byte range, then the raw data. Used for weights, gradients exported to
// the PyTorch oracle, and checkpoints.
#pragma once
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "anvil/core/tensor.h"

namespace anvil {

// Called during a write with the tensor bytes written so far and their total.
using WriteProgress = std::function<void(size_t written, size_t total)>;

// Writes to path + ".tmp" then renames, so a crash never leaves a torn file.
// A failed write (e.g. a full disk) removes the .tmp file and throws
// anvil::Error naming it and the system's reason.
void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {}, const WriteProgress& progress = {});

struct SafetensorsFile {
  std::map<std::string, Tensor> tensors;
  std::map<std::string, std::string> metadata;
};
// F32, BF16 and I32 tensors; throws anvil::Error naming the file and what is wrong.
SafetensorsFile load_safetensors(const std::string& path, MemCategory category = MemCategory::workspace);

}  // namespace anvil
