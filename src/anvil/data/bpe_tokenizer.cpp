#include "anvil/data/bpe_tokenizer.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <functional>
#include <sstream>

#include "anvil/core/error.h"

namespace anvil {

namespace {

using json = nlohmann::json;

// GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves,
// the other 68 bytes (controls, space, 0x7F-0xA0, 0xAD) take code points 256+
// in byte order, so every token is printable text in the vocabulary file.
struct ByteAlphabet {
  char32_t to_char[256];
  int16_t to_byte[324];  // code point -> byte, -1 if the code point is not in the alphabet
  ByteAlphabet() {
    std::fill(std::begin(to_byte), std::end(to_byte), int16_t{-1});
    int next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      to_char[b] = printable ? static_cast<char32_t>(b) : static_cast<char32_t>(next++);
      to_byte[to_char[b]] = static_cast<int16_t>(b);
    }
  }
};
const ByteAlphabet& alphabet() {
  static const ByteAlphabet a;
  return a;
}

// Turns a vocabulary string written in the byte alphabet into the raw bytes
// it stands for. False if it holds a character outside the alphabet.
bool unmap_bytes(std::string_view s, std::string& out) {
  out.clear();
  const auto& a = alphabet();
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    char32_t cp;
    if (c < 0x80) {
      cp = c;
      i += 1;
    } else if ((c >> 5) == 6 && i + 1 < s.size()) {
      cp = ((c & 0x1Fu) << 6) | (static_cast<unsigned char>(s[i + 1]) & 0x3Fu);
      i += 2;
    } else {
      return false;  // every alphabet character is at most 2 bytes in UTF-8
    }
    if (cp >= 324 || a.to_byte[cp] < 0) return false;
    out.push_back(static_cast<char>(a.to_byte[cp]));
  }
  return true;
}

std::string read_file(const std::string& path) {
  std::error_code ec;
  ANVIL_CHECK(std::filesystem::is_regular_file(path, ec),
              "tokenizer file ", path, " does not exist or is not a file; "
              "give a tokenizer.json or tiktoken file (scripts/prepare_llama3_tokenizer.sh makes Llama 3's)");
  std::ifstream f(path, std::ios::binary);
  ANVIL_CHECK(f.good(), "cannot open tokenizer file ", path, ": check its permissions");
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string regex_escape(std::string_view s) {
  std::string out;
  for (char c : s) {
    const unsigned char u = static_cast<unsigned char>(c);
    if (u < 0x80 && !std::isalnum(u)) out.push_back('\\');
    out.push_back(c);
  }
  return out;
}

int base64_value(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

bool base64_decode(std::string_view in, std::string& out) {
  out.clear();
  uint32_t acc = 0;
  int bits = 0;
  size_t i = 0;
  for (; i < in.size() && in[i] != '='; ++i) {
    const int v = base64_value(in[i]);
    if (v < 0) return false;
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((acc >> bits) & 0xFF));
    }
  }
  for (; i < in.size(); ++i)
    if (in[i] != '=') return false;
  return true;
}

std::atomic<uint64_t> g_next_serial{1};

// Pieces already encoded, per thread (encode may run on many threads at once,
// and a shared cache would need a lock on every piece). Keyed to one tokenizer
// instance by its serial number; bounded so a long run cannot grow it forever.
struct PieceCache {
  uint64_t owner = 0;
  std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> map;
};
constexpr size_t kCacheMaxEntries = 1 << 18;
constexpr size_t kCacheMaxPieceBytes = 256;

// Meta's Llama 3 special tokens after the 128,000 ordinary ones.
std::vector<std::string> llama3_special_tokens() {
  std::vector<std::string> names = {"<|begin_of_text|>",           "<|end_of_text|>",
                                    "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
                                    "<|reserved_special_token_2|>", "<|reserved_special_token_3|>",
                                    "<|start_header_id|>",         "<|end_header_id|>",
                                    "<|reserved_special_token_4|>", "<|eot_id|>"};
  for (int i = 5; i < 251; ++i) names.push_back("<|reserved_special_token_" + std::to_string(i) + "|>");
  return names;
}

}  // namespace

// ---------------------------------------------------------------------------
// Loading

std::unique_ptr<BpeTokenizer> BpeTokenizer::load(const std::string& path, const Options& opt) {
  std::ifstream f(path, std::ios::binary);
  char first = 0;
  while (f.get(first) && std::isspace(static_cast<unsigned char>(first))) {
  }
  if (f && first == '{') return from_hf_json(path, opt);
  return from_tiktoken(path, opt);
}

std::unique_ptr<BpeTokenizer> BpeTokenizer::from_hf_json(const std::string& path, const Options& opt) {
  const std::string text = read_file(path);
  json doc;
  try {
    doc = json::parse(text);
  } catch (const json::parse_error& e) {
    throw Error(detail::concat("tokenizer file ", path, " is not valid JSON (byte ", e.byte, "): ",
                               e.what(), "; regenerate it or check that it is a tokenizer.json"));
  }
  auto where = [&](const std::string& what) { return detail::concat(path, ": ", what); };
  ANVIL_CHECK(doc.is_object() && doc.contains("model") && doc["model"].is_object(),
              where("no \"model\" object; a Hugging Face tokenizer.json has one"));
  const json& model = doc["model"];
  const std::string type = model.value("type", std::string(model.contains("merges") ? "BPE" : ""));
  ANVIL_CHECK(type == "BPE", where("model.type is \"" + type +
                                   "\"; only byte-level \"BPE\" tokenizers are supported"));
  ANVIL_CHECK(!model.value("byte_fallback", false),
              where("model.byte_fallback is true (a SentencePiece-style BPE); only byte-level BPE is supported"));
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    ANVIL_CHECK(!model.contains(key) || model[key].is_null() ||
                    (model[key].is_string() && model[key].get<std::string>().empty()),
                where(std::string("model.") + key + " is set; it is not supported"));
  ANVIL_CHECK(!doc.contains("normalizer") || doc["normalizer"].is_null(),
              where("has a normalizer; byte-level BPE tokenizers with a normalizer are not supported"));
  ANVIL_CHECK(model.contains("vocab") && model["vocab"].is_object(), where("model.vocab is missing or not an object"));
  ANVIL_CHECK(model.contains("merges") && model["merges"].is_array(), where("model.merges is missing or not an array"));

  std::unique_ptr<BpeTokenizer> t(new BpeTokenizer());
  t->options_ = opt;
  t->name_ = path;
  t->ignore_merges_ = model.value("ignore_merges", false);

  std::string bytes;
  auto set_token = [&](int64_t id, const std::string& b, bool special) {
    ANVIL_CHECK(id >= 0 && id < (int64_t{1} << 31), where("token id " + std::to_string(id) + " is out of range"));
    if (static_cast<size_t>(id) >= t->token_bytes_.size()) {
      t->token_bytes_.resize(id + 1);
      t->special_.resize(id + 1, 0);
    }
    t->token_bytes_[id] = b;
    t->special_[id] = special;
  };
  for (const auto& [token, idj] : model["vocab"].items()) {
    ANVIL_CHECK(idj.is_number_integer(), where("model.vocab[\"" + token + "\"] is not an integer id"));
    const int64_t id = idj.get<int64_t>();
    if (unmap_bytes(token, bytes)) {
      set_token(id, bytes, false);
      t->by_bytes_.emplace(bytes, static_cast<int32_t>(id));
    } else {
      // Not written in the byte alphabet: no piece of text can produce it, but
      // it still decodes to its own text.
      set_token(id, token, false);
    }
  }

  const json& merges = model["merges"];
  t->merges_.reserve(merges.size() * 2);
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const json& m = merges[rank];
    std::string left, right;
    if (m.is_string()) {
      const std::string s = m.get<std::string>();
      const size_t sp = s.find(' ');
      ANVIL_CHECK(sp != std::string::npos && s.find(' ', sp + 1) == std::string::npos,
                  where("model.merges[" + std::to_string(rank) + "] = \"" + s + "\" is not two tokens separated by one space"));
      left = s.substr(0, sp);
      right = s.substr(sp + 1);
    } else {
      ANVIL_CHECK(m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string(),
                  where("model.merges[" + std::to_string(rank) + "] is neither \"a b\" nor [\"a\", \"b\"]"));
      left = m[0].get<std::string>();
      right = m[1].get<std::string>();
    }
    const auto lid = model["vocab"].find(left), rid = model["vocab"].find(right),
               mid = model["vocab"].find(left + right);
    ANVIL_CHECK(lid != model["vocab"].end() && rid != model["vocab"].end() && mid != model["vocab"].end(),
                where("model.merges[" + std::to_string(rank) + "] (\"" + left + "\", \"" + right +
                      "\") names a token that is not in model.vocab"));
    const uint64_t key = (static_cast<uint64_t>(lid->get<uint32_t>()) << 32) | rid->get<uint32_t>();
    // A repeated pair keeps its first (highest-priority) rank.
    t->merges_.emplace(key, Merge{static_cast<int32_t>(rank), mid->get<int32_t>()});
  }

  if (doc.contains("added_tokens") && doc["added_tokens"].is_array()) {
    for (const json& a : doc["added_tokens"]) {
      ANVIL_CHECK(a.is_object() && a.contains("id") && a["id"].is_number_integer() && a.contains("content") &&
                      a["content"].is_string(),
                  where("an entry of added_tokens lacks an integer \"id\" or a string \"content\""));
      const std::string content = a["content"].get<std::string>();
      ANVIL_CHECK(!content.empty(), where("added token " + a["id"].dump() + " has empty content"));
      set_token(a["id"].get<int64_t>(), content, true);
      t->specials_.emplace_back(content, a["id"].get<int32_t>());
    }
  }

  // Pre-tokenizer: Split steps with a regex, ByteLevel (GPT-2's regex if
  // use_regex), possibly inside a Sequence.
  std::function<void(const json&)> add_pre = [&](const json& p) {
    if (p.is_null()) return;
    const std::string ptype = p.value("type", std::string());
    if (ptype == "Sequence") {
      ANVIL_CHECK(p.contains("pretokenizers") && p["pretokenizers"].is_array(),
                  where("pre_tokenizer Sequence without a \"pretokenizers\" array"));
      for (const json& q : p["pretokenizers"]) add_pre(q);
    } else if (ptype == "Split") {
      ANVIL_CHECK(p.value("behavior", std::string("Isolated")) == "Isolated" && !p.value("invert", false),
                  where("pre_tokenizer Split with behavior \"" + p.value("behavior", std::string()) +
                        "\" or invert=true is not supported (only Isolated, not inverted)"));
      const json& pat = p.contains("pattern") ? p["pattern"] : json();
      if (pat.contains("Regex") && pat["Regex"].is_string()) {
        t->pretokenizer_.add(pat["Regex"].get<std::string>());
      } else {
        ANVIL_CHECK(pat.contains("String") && pat["String"].is_string(),
                    where("pre_tokenizer Split has no pattern {\"Regex\": ...} or {\"String\": ...}"));
        t->pretokenizer_.add(regex_escape(pat["String"].get<std::string>()));
      }
    } else if (ptype == "ByteLevel") {
      if (p.value("add_prefix_space", false)) t->add_prefix_space_ = true;
      if (p.value("use_regex", true)) t->pretokenizer_.add(kGpt2Pattern);
    } else {
      throw Error(where("pre_tokenizer type \"" + ptype +
                        "\" is not supported (Split, ByteLevel and Sequence are)"));
    }
  };
  if (doc.contains("pre_tokenizer")) add_pre(doc["pre_tokenizer"]);

  auto first_special = [&](std::initializer_list<const char*> names) {
    for (const char* n : names)
      for (const auto& [content, id] : t->specials_)
        if (content == n) return id;
    return -1;
  };
  t->bos_id_ = first_special({"<|begin_of_text|>", "<s>", "<|startoftext|>", "<bos>", "<|endoftext|>"});
  t->eos_id_ = first_special({"<|end_of_text|>", "</s>", "<|endoftext|>", "<eos>"});
  t->finish_setup(path);
  return t;
}

std::unique_ptr<BpeTokenizer> BpeTokenizer::from_tiktoken(const std::string& path, const Options& opt) {
  const std::string text = read_file(path);
  std::unique_ptr<BpeTokenizer> t(new BpeTokenizer());
  t->options_ = opt;
  t->name_ = path;
  t->ignore_merges_ = true;  // tiktoken takes a piece that is a token as it is
  std::string bytes;
  size_t line_no = 0;
  for (size_t pos = 0; pos < text.size();) {
    size_t end = text.find('\n', pos);
    if (end == std::string::npos) end = text.size();
    std::string_view line(text.data() + pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;
    const size_t sp = line.find(' ');
    int64_t rank = -1;
    bool ok = sp != std::string_view::npos && sp > 0 && base64_decode(line.substr(0, sp), bytes) && !bytes.empty();
    if (ok) {
      const std::string r(line.substr(sp + 1));
      char* e = nullptr;
      rank = std::strtoll(r.c_str(), &e, 10);
      ok = !r.empty() && *e == '\0' && rank >= 0 && rank < (int64_t{1} << 30);
    }
    ANVIL_CHECK(ok, path, ":", line_no, ": expected \"<base64 token bytes> <rank>\", got \"",
                std::string(line.substr(0, 80)), "\"; is this a tiktoken file (or a tokenizer.json starting with '{')?");
    if (static_cast<size_t>(rank) >= t->token_bytes_.size()) t->token_bytes_.resize(rank + 1);
    ANVIL_CHECK(t->by_bytes_.emplace(bytes, static_cast<int32_t>(rank)).second, path, ":", line_no,
                ": token bytes repeat an earlier line; the file is corrupt");
    t->token_bytes_[rank] = bytes;
  }
  ANVIL_CHECK(!t->by_bytes_.empty(), path, " holds no tokens; expected \"<base64 token bytes> <rank>\" lines");
  t->special_.assign(t->token_bytes_.size(), 0);
  // tiktoken has no merge list: a pair may merge when its concatenation is a
  // token, with that token's rank. Every split of every token into two tokens
  // gives such a pair.
  for (const auto& [tok, id] : t->by_bytes_)
    for (size_t k = 1; k < tok.size(); ++k) {
      const auto l = t->by_bytes_.find(std::string_view(tok).substr(0, k));
      if (l == t->by_bytes_.end()) continue;
      const auto r = t->by_bytes_.find(std::string_view(tok).substr(k));
      if (r == t->by_bytes_.end()) continue;
      t->merges_.emplace((static_cast<uint64_t>(l->second) << 32) | static_cast<uint32_t>(r->second), Merge{id, id});
    }
  const auto names = llama3_special_tokens();
  const int32_t base = static_cast<int32_t>(t->token_bytes_.size());
  for (size_t i = 0; i < names.size(); ++i) {
    t->token_bytes_.push_back(names[i]);
    t->special_.push_back(1);
    t->specials_.emplace_back(names[i], base + static_cast<int32_t>(i));
  }
  t->bos_id_ = base;      // <|begin_of_text|>, 128000 for Llama 3
  t->eos_id_ = base + 1;  // <|end_of_text|>, 128001
  t->pretokenizer_.add(kLlama3Pattern);
  t->finish_setup(path);
  return t;
}

void BpeTokenizer::finish_setup(const std::string& source) {
  for (int b = 0; b < 256; ++b) {
    const auto it = by_bytes_.find(std::string_view(reinterpret_cast<const char*>(&b), 1));
    ANVIL_CHECK(it != by_bytes_.end(), source, ": the vocabulary has no token for byte 0x", std::hex, b,
                "; a byte-level BPE needs all 256 single-byte tokens");
    byte_id_[b] = it->second;
  }
  std::sort(specials_.begin(), specials_.end(),
            [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
  for (const auto& s : specials_) special_first_byte_[static_cast<unsigned char>(s.first[0])] = true;
  serial_ = g_next_serial.fetch_add(1);
}

// ---------------------------------------------------------------------------
// Encoding

const BpeTokenizer::Merge* BpeTokenizer::find_merge(int32_t left, int32_t right) const {
  const auto it = merges_.find((static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right));
  return it == merges_.end() ? nullptr : &it->second;
}

// Merges the bytes of one piece. Each symbol is named by the offset of its
// first byte; a heap holds the candidate pairs by (rank, offset), so the pair
// merged next is the lowest rank and, among equals, the leftmost, as in the
// reference implementations. A popped pair is stale if either side has
// changed since it was pushed; the (offset, id) of both sides detects that,
// because an id fixes a symbol's length.
void BpeTokenizer::bpe(std::string_view piece, std::vector<int32_t>& out) const {
  struct Candidate {
    int32_t rank, pos, left, right;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  const int32_t n = static_cast<int32_t>(piece.size());
  thread_local std::vector<int32_t> id, next, prev;
  thread_local std::vector<Candidate> heap;  // a min-heap through std::greater
  id.resize(n);
  next.resize(n);
  prev.resize(n);
  for (int32_t i = 0; i < n; ++i) {
    id[i] = byte_id_[static_cast<unsigned char>(piece[i])];
    next[i] = i + 1 < n ? i + 1 : -1;
    prev[i] = i - 1;
  }
  heap.clear();
  auto push = [&](int32_t i) {
    if (i < 0 || next[i] < 0) return;
    if (const Merge* m = find_merge(id[i], id[next[i]])) {
      heap.push_back({m->rank, i, id[i], id[next[i]]});
      std::push_heap(heap.begin(), heap.end(), std::greater<>{});
    }
  };
  for (int32_t i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), std::greater<>{});
    const Candidate c = heap.back();
    heap.pop_back();
    const int32_t r = next[c.pos];
    // id[pos] is -1 once the symbol was absorbed into its left neighbour.
    if (id[c.pos] != c.left || r < 0 || id[r] != c.right) continue;
    id[c.pos] = find_merge(c.left, c.right)->id;
    id[r] = -1;
    next[c.pos] = next[r];
    if (next[r] >= 0) prev[next[r]] = c.pos;
    push(prev[c.pos]);
    push(c.pos);
  }
  for (int32_t i = 0; i >= 0; i = next[i]) out.push_back(id[i]);
}

void BpeTokenizer::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  if (piece.size() == 1) {
    out.push_back(byte_id_[static_cast<unsigned char>(piece[0])]);
    return;
  }
  if (ignore_merges_) {
    const auto it = by_bytes_.find(piece);
    if (it != by_bytes_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  if (piece.size() > kCacheMaxPieceBytes) {
    bpe(piece, out);
    return;
  }
  thread_local PieceCache cache;
  if (cache.owner != serial_) {
    cache.map.clear();
    cache.owner = serial_;
  }
  if (const auto it = cache.map.find(piece); it != cache.map.end()) {
    out.insert(out.end(), it->second.begin(), it->second.end());
    return;
  }
  const size_t before = out.size();
  bpe(piece, out);
  if (cache.map.size() >= kCacheMaxEntries) cache.map.clear();
  cache.map.emplace(std::string(piece), std::vector<int32_t>(out.begin() + static_cast<std::ptrdiff_t>(before), out.end()));
}

void BpeTokenizer::encode_text(std::string_view text, std::vector<int32_t>& out) const {
  if (text.empty()) return;
  std::string prefixed;
  if (add_prefix_space_ && text[0] != ' ') {
    prefixed = " ";
    prefixed += text;
    text = prefixed;
  }
  thread_local std::vector<std::string_view> pieces;
  pretokenizer_.split(text, pieces);
  for (std::string_view p : pieces) encode_piece(p, out);
}

void BpeTokenizer::encode_append(std::string_view text, std::vector<int32_t>& out) const {
  if (!options_.match_special_tokens || specials_.empty()) {
    encode_text(text, out);
    return;
  }
  // Special tokens are found first, leftmost and then longest, and the text
  // between them is pre-tokenized on its own.
  size_t done = 0;
  for (size_t i = 0; i < text.size(); ++i) {
    if (!special_first_byte_[static_cast<unsigned char>(text[i])]) continue;
    for (const auto& [content, sid] : specials_) {
      if (text.compare(i, content.size(), content) != 0) continue;
      encode_text(text.substr(done, i - done), out);
      out.push_back(sid);
      done = i + content.size();
      i = done - 1;
      break;
    }
  }
  encode_text(text.substr(done), out);
}

std::vector<int32_t> BpeTokenizer::encode(const std::string& text) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 8);
  encode_append(text, out);
  return out;
}

// ---------------------------------------------------------------------------
// Decoding and lookups

std::string BpeTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string out;
  for (size_t i = 0; i < ids.size(); ++i) out += token_bytes(ids[i]);
  return out;
}

const std::string& BpeTokenizer::token_bytes(int32_t id) const {
  ANVIL_CHECK(id >= 0 && static_cast<size_t>(id) < token_bytes_.size() && !token_bytes_[id].empty(),
              "token id ", id, " is not in the vocabulary of ", name_, " (", token_bytes_.size(),
              " ids); was the text encoded with another tokenizer?");
  return token_bytes_[id];
}

bool BpeTokenizer::is_special(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < special_.size() && special_[id];
}

int32_t BpeTokenizer::token_id(std::string_view bytes) const {
  for (const auto& [content, sid] : specials_)
    if (content == bytes) return sid;
  const auto it = by_bytes_.find(bytes);
  return it == by_bytes_.end() ? -1 : it->second;
}

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& spec) {
  if (spec == "bytes") return std::make_unique<ByteTokenizer>();
  return BpeTokenizer::load(spec);
}

}  // namespace anvil
