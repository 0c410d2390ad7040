#include "anvil/data/tokenizer.h"

namespace anvil {

std::vector<int32_t> ByteTokenizer::encode(const std::string& text) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size());
  for (unsigned char c : text) ids.push_back(c);
  return ids;
}

std::string ByteTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string out;
  for (int32_t id : ids)
    if (id >= 0 && id < 256) out.push_back(static_cast<char>(id));
  return out;
}

std::vector<int32_t> tokenize_documents(const Tokenizer& tok, const std::vector<std::string>& texts) {
  std::vector<int32_t> stream;
  for (const std::string& t : texts) {
    if (tok.bos_id() >= 0) stream.push_back(tok.bos_id());  // none where the tokenizer has none (-1)
    const auto ids = tok.encode(t);
    stream.insert(stream.end(), ids.begin(), ids.end());
    if (tok.eos_id() >= 0) stream.push_back(tok.eos_id());
  }
  return stream;
}

}  // namespace anvil
