// Byte-level BPE, as GPT-2, Llama 3 and tiktoken do it: text is cut into pieces
// by a regular expression, each piece's UTF-8 bytes start as one token per
// byte, and adjacent tokens merge in the order of the merge list (lowest rank
// first, leftmost first on equal ranks) until no listed pair remains.
//
// Two file formats load into it:
//  - Hugging Face tokenizer.json with model.type "BPE": vocab and merges are
//    strings in GPT-2's byte-to-unicode alphabet; added_tokens are matched
//    literally in the text before pre-tokenization.
//  - tiktoken (`<base64 bytes> <rank>` per line, Llama 3's tokenizer.model):
//    a token's rank is its id and its merge priority; Llama 3's pattern and
//    its 256 special tokens (ids 128000-128255 for the 128,000-token file) are
//    added.
//
// BOS/EOS: Llama 3's tiktoken file uses 128000/128001. For a tokenizer.json
// the first added token named <|begin_of_text|>, <s>, <|startoftext|>, <bos>
// or <|endoftext|> is BOS, and the first named <|end_of_text|>, </s>,
// <|endoftext|> or <eos> is EOS (GPT-2's <|endoftext|> serves as both);
// without one, the id is -1.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "anvil/data/pretokenizer.h"
#include "anvil/data/tokenizer.h"

namespace anvil {

// Hash for string keys that also accepts string_view, so lookups of a piece
// of the text allocate nothing.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using StringIdMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

struct BpeOptions {
  // Added/special tokens written in the text (e.g. "<|eot_id|>") encode to
  // their ids, as Hugging Face tokenizers and tiktoken with
  // allowed_special="all" do. Off: they are ordinary text, as Meta's Llama 3
  // encode() does by default, which keeps a crawled document from forging
  // document boundaries.
  bool match_special_tokens = true;
};

class BpeTokenizer final : public Tokenizer {
 public:
  using Options = BpeOptions;

  // Chooses the format by content: a file starting with '{' is tokenizer.json.
  static std::unique_ptr<BpeTokenizer> load(const std::string& path, const Options& opt);
  static std::unique_ptr<BpeTokenizer> load(const std::string& path) { return load(path, Options{}); }
  static std::unique_ptr<BpeTokenizer> from_hf_json(const std::string& path, const Options& opt = {});
  static std::unique_ptr<BpeTokenizer> from_tiktoken(const std::string& path, const Options& opt = {});

  // No BOS or EOS is added; callers add bos_id()/eos_id() where they want them.
  std::vector<int32_t> encode(const std::string& text) const override;
  void encode_append(std::string_view text, std::vector<int32_t>& out) const;
  // Bytes of the tokens, concatenated: special tokens appear as their text,
  // and invalid UTF-8 that went in comes back byte for byte. Throws
  // anvil::Error for an id outside the vocabulary.
  std::string decode(const std::vector<int32_t>& ids) const override;
  int64_t vocab_size() const override { return static_cast<int64_t>(token_bytes_.size()); }
  int32_t bos_id() const override { return bos_id_; }
  int32_t eos_id() const override { return eos_id_; }
  std::string name() const override { return name_; }

  // Id of an exact token (ordinary or special), or -1.
  int32_t token_id(std::string_view bytes) const;
  // Raw bytes of a token.
  const std::string& token_bytes(int32_t id) const;
  bool is_special(int32_t id) const;

 private:
  BpeTokenizer() = default;
  struct Merge {
    int32_t rank;
    int32_t id;
  };
  void finish_setup(const std::string& source);
  void encode_text(std::string_view text, std::vector<int32_t>& out) const;
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;
  void bpe(std::string_view piece, std::vector<int32_t>& out) const;
  const Merge* find_merge(int32_t left, int32_t right) const;

  std::string name_;
  Options options_;
  std::vector<std::string> token_bytes_;  // id -> raw bytes ("" for an unused id)
  std::vector<uint8_t> special_;           // id -> 1 for added/special tokens
  StringIdMap by_bytes_;                   // ordinary tokens: raw bytes -> id
  std::unordered_map<uint64_t, Merge> merges_;  // (left id, right id) -> rank, result
  int32_t byte_id_[256] = {};
  bool ignore_merges_ = false;  // a piece that is itself a token encodes to it directly
  bool add_prefix_space_ = false;
  Pretokenizer pretokenizer_;
  // Special tokens, longest first, matched literally before pre-tokenization.
  std::vector<std::pair<std::string, int32_t>> specials_;
  bool special_first_byte_[256] = {};
  int32_t bos_id_ = -1, eos_id_ = -1;
  uint64_t serial_ = 0;  // identifies this instance to the per-thread piece cache
};

// "bytes" gives the byte-level tokenizer; anything else is a file path for
// BpeTokenizer::load.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& spec);

}  // namespace anvil
