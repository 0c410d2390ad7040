// Reading and writing the safetensors format (Hugging Face's): an 8-byte
// little-endian header length, a JSON header naming each tensor's dtype, shape
// and byte range, then the raw data. Used for weights, gradients exported to
// the PyTorch oracle, checkpoints and Hugging Face exports.
#pragma once
#include <functional>
#include <cstdint>
#include <fstream>
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
// anvil::Error naming it and the system's reason. A tensor on a GPU comes
// over in pieces through `staging`, a host tensor (required then), so the
// host holds one piece of it at a time, not the tensor.
void save_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                      const std::map<std::string, std::string>& metadata = {}, const WriteProgress& progress = {},
                      const Tensor& staging = {});

struct SafetensorsFile {
  std::map<std::string, Tensor> tensors;
  std::map<std::string, std::string> metadata;
};
// F32, BF16 and I32 tensors; throws anvil::Error naming the file and what is wrong.
SafetensorsFile load_safetensors(const std::string& path, MemCategory category = MemCategory::workspace);

// One tensor as the header describes it. dtype is the format's own name
// ("F32", "BF16", "F16", "I64", ...); [begin, end) are absolute file offsets.
struct SafetensorsEntry {
  std::string dtype;
  Shape shape;
  uint64_t begin = 0, end = 0;
  uint64_t nbytes() const { return end - begin; }
};

// A file opened for reading tensor by tensor, so a caller can check names,
// dtypes and shapes before reading any data, read each tensor straight into
// its destination, and skip tensors it does not want (a whole Llama 3 8B
// shard need not sit in memory next to the weights it fills).
class SafetensorsReader {
 public:
  // Reads and checks the header: every byte range lies inside the file and,
  // for the dtypes the format defines, matches the shape. Throws anvil::Error.
  explicit SafetensorsReader(std::string path);

  const std::string& path() const { return path_; }
  const std::map<std::string, SafetensorsEntry>& entries() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // Copies tensor `name`'s raw bytes (entry.nbytes() of them) to dst.
  void read(const std::string& name, void* dst);

 private:
  std::string path_;
  std::ifstream in_;
  std::map<std::string, SafetensorsEntry> entries_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace anvil
