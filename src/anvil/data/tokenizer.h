// Tokenizers turn text into token ids. The byte-level tokenizer is the
// dependency-free fallback: every byte is a token, plus document markers.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace anvil {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::vector<int32_t> encode(const std::string& text) const = 0;
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
  virtual int64_t vocab_size() const = 0;
  virtual int32_t bos_id() const = 0;
  virtual int32_t eos_id() const = 0;
  virtual std::string name() const = 0;
};

// Ids 0-255 are the bytes of UTF-8 text; 256 begins and 257 ends a document.
class ByteTokenizer final : public Tokenizer {
 public:
  std::vector<int32_t> encode(const std::string& text) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;
  int64_t vocab_size() const override { return 258; }
  int32_t bos_id() const override { return 256; }
  int32_t eos_id() const override { return 257; }
  std::string name() const override { return "bytes"; }
};

// One stream of documents: BOS, text, EOS for each (as Llama 3 packs them);
// a tokenizer without a BOS or EOS (-1) gets none.
std::vector<int32_t> tokenize_documents(const Tokenizer& tok, const std::vector<std::string>& texts);

}  // namespace anvil
