#include "anvil/data/loader.h"

#include "anvil/core/error.h"

namespace anvil {

PackedLoader::PackedLoader(std::vector<int32_t> stream, int64_t seq_len) : stream_(std::move(stream)), seq_len_(seq_len) {
  ANVIL_CHECK(static_cast<int64_t>(stream_.size()) > seq_len_ + 1, "the dataset has ", stream_.size(),
              " tokens, fewer than one sequence of training.seq_len + 1 = ", seq_len_ + 1,
              "; use a shorter seq_len or more data");
}

void PackedLoader::next_batch(Tensor& tokens, Tensor& targets) {
  const int64_t B = tokens.size(0);
  ANVIL_ASSERT(tokens.size(1) == seq_len_ && targets.shape() == tokens.shape());
  int32_t* tok = tokens.data<int32_t>();
  int32_t* tgt = targets.data<int32_t>();
  const int64_t n = static_cast<int64_t>(stream_.size());
  for (int64_t b = 0; b < B; ++b) {
    if (state_.position + seq_len_ + 1 > n) {  // not enough left for a window: next epoch
      state_.position = 0;
      ++state_.epoch;
    }
    const int32_t* w = stream_.data() + state_.position;
    for (int64_t t = 0; t < seq_len_; ++t) {
      tok[b * seq_len_ + t] = w[t];
      tgt[b * seq_len_ + t] = w[t + 1];
    }
    // Windows overlap by one token: the last target becomes the next window's first input.
    state_.position += seq_len_;
  }
}

std::vector<int32_t> tokenize_documents(const Tokenizer& tok, const std::vector<std::string>& texts) {
  std::vector<int32_t> stream;
  for (const std::string& t : texts) {
    stream.push_back(tok.bos_id());
    const auto ids = tok.encode(t);
    stream.insert(stream.end(), ids.begin(), ids.end());
    stream.push_back(tok.eos_id());
  }
  return stream;
}

}  // namespace anvil
