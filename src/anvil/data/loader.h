// The packing data loader: documents are tokenized, joined into one stream
// (each document wrapped in BOS … EOS), and cut into consecutive windows of
// seq_len + 1 tokens; inputs are the first seq_len, targets the last seq_len.
// No padding, no token wasted. The position in the stream is the whole state,
// so a resumed run continues with exactly the next batch.
#pragma once
#include <cstdint>
#include <vector>

#include "anvil/core/tensor.h"
#include "anvil/data/tokenizer.h"

namespace anvil {

struct LoaderState {
  int64_t position = 0;  // index of the next window's first token
  int64_t epoch = 0;     // completed passes over the stream
};

class PackedLoader {
 public:
  PackedLoader(std::vector<int32_t> stream, int64_t seq_len);

  // tokens, targets (B, seq_len) i32, filled with the next B windows.
  void next_batch(Tensor& tokens, Tensor& targets);

  const LoaderState& state() const { return state_; }
  void set_state(const LoaderState& s) { state_ = s; }
  int64_t num_tokens() const { return static_cast<int64_t>(stream_.size()); }

 private:
  std::vector<int32_t> stream_;
  int64_t seq_len_;
  LoaderState state_;
};

// Tokenizes documents into one stream: BOS, text, EOS for each.
std::vector<int32_t> tokenize_documents(const Tokenizer& tok, const std::vector<std::string>& texts);

}  // namespace anvil
