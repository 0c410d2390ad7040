// Byte-level BPE training (Sennrich et al. 2016, in GPT-2's byte-level form):
// split text into words with a regex pre-tokenizer, count the words, then
// repeatedly merge the most frequent adjacent pair of symbols. The result is
// written as a Hugging Face `tokenizer.json`.
//
// Vocabulary layout (ids):
//   0 … 255                         the 256 single bytes, id = byte value
//   256 … vocab_size-n-1            the merges, in the order they were learnt
//                                   (merge i makes token 256 + i)
//   vocab_size-n … vocab_size-1     the n special tokens, in the order given;
//                                   with the defaults (vocab 2048) that is
//                                   <|begin_of_text|> = 2046 (BOS) and
//                                   <|end_of_text|> = 2047 (EOS)
//
// Determinism: words are ordered by their bytes before training, and among
// pairs of equal count the one with the smaller (left id, right id) wins, so
// ties go to pairs of earlier tokens. Two runs on the same text give the same
// file byte for byte, whatever the hash tables' iteration order.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace anvil {

// Llama 3's pre-tokenizer: contractions, words with one leading non-letter,
// numbers of up to three digits, punctuation runs, newline runs, whitespace.
extern const char* const kLlama3PreTokenizerPattern;

// Splits text into pre-tokens ("words") with a PCRE2 pattern (UTF, UCP, JIT)
// and counts them. Special-token strings are cut out of the text first, so
// they never take part in merges. Bytes that are not valid UTF-8 never match
// the pattern; each such stretch becomes a word of its own (as Hugging Face's
// Split with behaviour Isolated keeps unmatched stretches).
class WordCounter {
 public:
  explicit WordCounter(const std::string& pattern = kLlama3PreTokenizerPattern,
                       std::vector<std::string> special_tokens = {});
  ~WordCounter();
  WordCounter(const WordCounter&) = delete;
  WordCounter& operator=(const WordCounter&) = delete;

  void add_text(std::string_view text);
  // Calls `fn` with every pre-token of `text`, in order (special tokens are not cut here).
  void split(std::string_view text, const std::function<void(std::string_view)>& fn) const;

  const std::unordered_map<std::string, int64_t>& counts() const { return counts_; }
  int64_t total_words() const { return total_words_; }
  int64_t total_bytes() const { return total_bytes_; }

 private:
  struct Regex;
  std::unique_ptr<Regex> re_;
  std::vector<std::string> special_tokens_;
  std::unordered_map<std::string, int64_t> counts_;
  int64_t total_words_ = 0;
  int64_t total_bytes_ = 0;
};

struct BpeTrainOptions {
  int64_t vocab_size = 2048;
  std::vector<std::string> special_tokens = {"<|begin_of_text|>", "<|end_of_text|>"};
  std::string pattern = kLlama3PreTokenizerPattern;
  // Called about every 1% of the merges and once at the end: (merges done, merges wanted).
  std::function<void(int64_t, int64_t)> progress;
};

struct BpeModel {
  std::vector<std::string> tokens;                 // id -> raw bytes; bytes, then merges
  std::vector<std::pair<int32_t, int32_t>> merges;  // merge i joins these two ids into 256 + i
  std::vector<std::string> special_tokens;          // id = first_special_id() + index
  std::string pattern;                              // the pre-tokenizer pattern trained with

  int64_t vocab_size() const { return static_cast<int64_t>(tokens.size() + special_tokens.size()); }
  int32_t first_special_id() const { return static_cast<int32_t>(tokens.size()); }
};

// Throws anvil::Error when vocab_size < 256 + specials, the specials are empty,
// repeated or not UTF-8, the counts are empty, or the corpus runs out of pairs
// before reaching vocab_size (the message gives the largest size it supports).
BpeModel train_bpe(const std::unordered_map<std::string, int64_t>& word_counts, const BpeTrainOptions& options);
BpeModel train_bpe(const std::vector<std::string>& texts, const BpeTrainOptions& options);

// GPT-2's printable stand-in for a byte string: each byte becomes one Unicode
// character (printable Latin-1 bytes stand for themselves, the rest map to
// U+0100 upwards), returned as UTF-8.
std::string bytes_to_unicode(std::string_view bytes);

// The Hugging Face tokenizer.json text for a trained model.
std::string bpe_tokenizer_json(const BpeModel& model);
// Writes it to `path` through a temporary file and a rename, so a crash never
// leaves a half-written tokenizer behind.
void write_bpe_tokenizer_json(const BpeModel& model, const std::string& path);

}  // namespace anvil
