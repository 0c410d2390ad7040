#include "anvil/data/bpe_trainer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <queue>
#include <set>

#include "anvil/core/error.h"

namespace anvil {

const char* const kLlama3PreTokenizerPattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// ---------------------------------------------------------------------------
// Pre-tokenization

struct WordCounter::Regex {
  pcre2_code* code = nullptr;
  pcre2_jit_stack* jit_stack = nullptr;
  pcre2_match_context* mcontext = nullptr;

  explicit Regex(const std::string& pattern) {
    int err = 0;
    PCRE2_SIZE err_offset = 0;
    // MATCH_INVALID_UTF: invalid UTF-8 in the text simply never matches,
    // instead of being undefined behaviour or an error for the whole text.
    code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                         PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &err, &err_offset, nullptr);
    if (!code) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof msg);
      throw Error(detail::concat("pre-tokenizer pattern does not compile at offset ", err_offset, ": ",
                                 reinterpret_cast<const char*>(msg), "; pattern: ", pattern));
    }
    // JIT makes matching several times faster; without it PCRE2 still works.
    if (pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0) {
      jit_stack = pcre2_jit_stack_create(32 * 1024, 4 * 1024 * 1024, nullptr);
      mcontext = pcre2_match_context_create(nullptr);
      if (jit_stack && mcontext) pcre2_jit_stack_assign(mcontext, nullptr, jit_stack);
    }
  }
  ~Regex() {
    if (mcontext) pcre2_match_context_free(mcontext);
    if (jit_stack) pcre2_jit_stack_free(jit_stack);
    pcre2_code_free(code);
  }
};

WordCounter::WordCounter(const std::string& pattern, std::vector<std::string> special_tokens)
    : re_(std::make_unique<Regex>(pattern)), special_tokens_(std::move(special_tokens)) {
  for (const auto& s : special_tokens_) ANVIL_CHECK(!s.empty(), "a special token is the empty string");
}

WordCounter::~WordCounter() = default;

void WordCounter::split(std::string_view text, const std::function<void(std::string_view)>& fn) const {
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(re_->code, nullptr);
  ANVIL_ASSERT(md != nullptr);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t pos = 0, emitted = 0;  // search start; end of the last piece handed out
  while (pos < text.size()) {
    const int rc = pcre2_match(re_->code, subject, text.size(), pos, 0, md, re_->mcontext);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof msg);
      pcre2_match_data_free(md);
      throw Error(detail::concat("pre-tokenizer failed at byte ", pos, ": ", reinterpret_cast<const char*>(msg)));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    const size_t start = ov[0], end = ov[1];
    if (start > emitted) fn(text.substr(emitted, start - emitted));  // an unmatched stretch
    if (end > start) {
      fn(text.substr(start, end - start));
      emitted = end;
      pos = end;
    } else {
      // An empty match: step over one character so the search moves on.
      emitted = start;
      pos = start + 1;
      while (pos < text.size() && (static_cast<unsigned char>(text[pos]) & 0xC0) == 0x80) ++pos;
    }
  }
  if (emitted < text.size()) fn(text.substr(emitted));
  pcre2_match_data_free(md);
}

void WordCounter::add_text(std::string_view text) {
  total_bytes_ += static_cast<int64_t>(text.size());
  auto count = [this](std::string_view word) {
    ++counts_[std::string(word)];
    ++total_words_;
  };
  // Cut out special tokens: the earliest occurrence of any of them, repeatedly.
  size_t pos = 0;
  while (pos < text.size()) {
    size_t best = std::string_view::npos, best_len = 0;
    for (const auto& s : special_tokens_) {
      const size_t at = text.find(s, pos);
      if (at < best || (at == best && s.size() > best_len)) best = at, best_len = s.size();
    }
    const size_t stop = best == std::string_view::npos ? text.size() : best;
    if (stop > pos) split(text.substr(pos, stop - pos), count);
    if (best == std::string_view::npos) break;
    pos = best + best_len;
  }
}

// ---------------------------------------------------------------------------
// Training

namespace {

using PairKey = uint64_t;  // left id in the high half, right id in the low half: orders like (left, right)
PairKey pair_key(int32_t a, int32_t b) { return (static_cast<uint64_t>(a) << 32) | static_cast<uint32_t>(b); }
int32_t left_of(PairKey k) { return static_cast<int32_t>(k >> 32); }
int32_t right_of(PairKey k) { return static_cast<int32_t>(k & 0xffffffffu); }

struct HeapEntry {
  int64_t count;
  PairKey pair;
  // std::priority_queue keeps the largest on top: higher count first, then the smaller pair.
  bool operator<(const HeapEntry& o) const { return count != o.count ? count < o.count : pair > o.pair; }
};

struct Word {
  std::vector<int32_t> symbols;
  int64_t count;
};

bool is_valid_utf8_text(const std::string& s) {
  try {
    (void)nlohmann::json(s).dump();
    return true;
  } catch (const nlohmann::json::exception&) {
    return false;
  }
}

void check_options(const BpeTrainOptions& options) {
  const auto& specials = options.special_tokens;
  const int64_t minimum = 256 + static_cast<int64_t>(specials.size());
  ANVIL_CHECK(options.vocab_size >= minimum, "vocab size ", options.vocab_size, " is too small: a byte-level BPE ",
              "vocabulary needs the 256 byte tokens plus ", specials.size(), " special token(s), so at least ",
              minimum, "; pass a larger --vocab-size");
  ANVIL_CHECK(options.vocab_size <= (int64_t{1} << 30), "vocab size ", options.vocab_size,
              " is too large (at most 2^30)");
  std::set<std::string> seen;
  for (const auto& s : specials) {
    ANVIL_CHECK(!s.empty(), "a special token is the empty string; give each special token some text");
    ANVIL_CHECK(seen.insert(s).second, "special token '", s, "' is listed twice");
    ANVIL_CHECK(is_valid_utf8_text(s), "special token '", s, "' is not valid UTF-8");
  }
}

}  // namespace

BpeModel train_bpe(const std::unordered_map<std::string, int64_t>& word_counts, const BpeTrainOptions& options) {
  check_options(options);
  ANVIL_CHECK(!word_counts.empty(), "the training text is empty: there are no words to learn merges from; "
              "check the input files");

  BpeModel model;
  model.pattern = options.pattern;
  model.special_tokens = options.special_tokens;
  model.tokens.reserve(static_cast<size_t>(options.vocab_size));
  for (int b = 0; b < 256; ++b) model.tokens.emplace_back(1, static_cast<char>(b));
  const int64_t wanted = options.vocab_size - 256 - static_cast<int64_t>(options.special_tokens.size());

  // Words in byte order, so word indices (and everything after) do not depend on hashing.
  std::vector<const std::pair<const std::string, int64_t>*> sorted;
  sorted.reserve(word_counts.size());
  for (const auto& wc : word_counts)
    if (wc.second > 0 && !wc.first.empty()) sorted.push_back(&wc);
  std::sort(sorted.begin(), sorted.end(), [](const auto* a, const auto* b) { return a->first < b->first; });
  std::vector<Word> words(sorted.size());
  for (size_t w = 0; w < sorted.size(); ++w) {
    words[w].count = sorted[w]->second;
    words[w].symbols.reserve(sorted[w]->first.size());
    for (unsigned char c : sorted[w]->first) words[w].symbols.push_back(c);
  }

  // Pair counts, and for each pair the words it occurs in (sorted, possibly
  // stale: a word listed under a pair may have lost it to a later merge).
  std::unordered_map<PairKey, int64_t> counts;
  std::unordered_map<PairKey, std::vector<int32_t>> where;
  for (size_t w = 0; w < words.size(); ++w) {
    const auto& s = words[w].symbols;
    for (size_t i = 0; i + 1 < s.size(); ++i) {
      const PairKey k = pair_key(s[i], s[i + 1]);
      counts[k] += words[w].count;
      auto& list = where[k];
      if (list.empty() || list.back() != static_cast<int32_t>(w)) list.push_back(static_cast<int32_t>(w));
    }
  }
  // A merge only lowers the counts of existing pairs; the pairs it creates all
  // contain the new token. So heap entries are never below the true count, and
  // an entry whose count is stale is re-queued with the current one when it
  // surfaces (lazy deletion): the first entry that is current is the maximum.
  std::vector<HeapEntry> initial;
  initial.reserve(counts.size());
  for (const auto& [k, c] : counts) initial.push_back({c, k});
  std::priority_queue<HeapEntry> heap(std::less<HeapEntry>(), std::move(initial));

  const int64_t report_every = std::max<int64_t>(1, wanted / 100);
  std::vector<PairKey> created;  // pairs that contain the new token, queued after each merge
  while (static_cast<int64_t>(model.merges.size()) < wanted) {
    if (heap.empty()) {
      const int64_t reached = 256 + static_cast<int64_t>(model.merges.size() + options.special_tokens.size());
      throw Error(detail::concat("the training text supports only ", model.merges.size(), " merges (every word is ",
                                 "a single token after that), so the vocabulary can reach ", reached, " tokens, not ",
                                 options.vocab_size, "; give more text or pass --vocab-size ", reached,
                                 " or less"));
    }
    const HeapEntry top = heap.top();
    heap.pop();
    const auto it = counts.find(top.pair);
    const int64_t current = it == counts.end() ? 0 : it->second;
    ANVIL_ASSERT(current <= top.count, "a pair count grew after it was queued");
    if (current != top.count) {
      if (current > 0) heap.push({current, top.pair});
      continue;
    }

    const int32_t a = left_of(top.pair), b = right_of(top.pair);
    const int32_t merged = static_cast<int32_t>(model.tokens.size());
    model.merges.emplace_back(a, b);
    model.tokens.push_back(model.tokens[static_cast<size_t>(a)] + model.tokens[static_cast<size_t>(b)]);

    std::vector<int32_t> affected = std::move(where[top.pair]);
    where.erase(top.pair);
    counts.erase(top.pair);
    created.clear();
    std::vector<int32_t> next;
    for (const int32_t w : affected) {
      Word& word = words[static_cast<size_t>(w)];
      auto& s = word.symbols;
      // Merge left to right (so "a a a" with pair (a, a) becomes "aa a"),
      // adjusting the counts of the neighbouring pairs as each merge happens.
      next.clear();
      bool changed = false;
      for (size_t i = 0; i < s.size();) {
        if (i + 1 < s.size() && s[i] == a && s[i + 1] == b) {
          changed = true;
          if (!next.empty()) {
            // When the left neighbour is itself this step's merge ("a b a b"), the
            // old pair (b, a) was already taken away as that merge's right neighbour.
            if (next.back() != merged) {
              const PairKey old_left = pair_key(next.back(), a);
              if (auto c = counts.find(old_left); c != counts.end() && (c->second -= word.count) <= 0)
                counts.erase(c);
            }
            const PairKey new_left = pair_key(next.back(), merged);
            counts[new_left] += word.count;
            created.push_back(new_left);
            auto& list = where[new_left];
            if (list.empty() || list.back() != w) list.push_back(w);
          }
          if (i + 2 < s.size()) {
            // The right neighbour pair (b, x) goes; (merged, x) is added when x is
            // itself copied, or when it is the start of another merge, by the branch above.
            const PairKey old_right = pair_key(b, s[i + 2]);
            if (auto c = counts.find(old_right); c != counts.end() && (c->second -= word.count) <= 0) counts.erase(c);
          }
          next.push_back(merged);
          i += 2;
        } else {
          if (!next.empty() && next.back() == merged) {
            const PairKey new_right = pair_key(merged, s[i]);
            counts[new_right] += word.count;
            created.push_back(new_right);
            auto& list = where[new_right];
            if (list.empty() || list.back() != w) list.push_back(w);
          }
          next.push_back(s[i]);
          i += 1;
        }
      }
      if (changed) s.swap(next);
    }
    std::sort(created.begin(), created.end());
    created.erase(std::unique(created.begin(), created.end()), created.end());
    for (const PairKey k : created)
      if (auto c = counts.find(k); c != counts.end() && c->second > 0) heap.push({c->second, k});

    const auto done = static_cast<int64_t>(model.merges.size());
    if (options.progress && (done % report_every == 0 || done == wanted)) options.progress(done, wanted);
  }
  if (options.progress && wanted == 0) options.progress(0, 0);

  // A special token spelt like a byte (say "a") would give one string two ids.
  // (Learnt tokens cannot match one: special tokens are cut out of the text.)
  std::set<std::string> strings(model.tokens.begin(), model.tokens.end());
  for (const auto& s : model.special_tokens)
    ANVIL_CHECK(!strings.count(s), "special token '", s, "' is also an ordinary token of the vocabulary (a byte or ",
                "a learnt merge); choose a longer special token such as <|", s, "|>");
  return model;
}

BpeModel train_bpe(const std::vector<std::string>& texts, const BpeTrainOptions& options) {
  check_options(options);
  WordCounter counter(options.pattern, options.special_tokens);
  for (const auto& t : texts) counter.add_text(t);
  return train_bpe(counter.counts(), options);
}

// ---------------------------------------------------------------------------
// tokenizer.json

std::string bytes_to_unicode(std::string_view bytes) {
  // GPT-2's table: printable bytes ('!'…'~', '¡'…'¬', '®'…'ÿ') keep their code
  // point; the other 68 bytes take U+0100, U+0101, … in byte order.
  static const auto table = [] {
    std::array<uint32_t, 256> cp{};
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
      cp[b] = printable ? b : next++;
    }
    return cp;
  }();
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char c : bytes) {
    const uint32_t u = table[c];
    if (u < 0x80) {
      out += static_cast<char>(u);
    } else {  // every code point here is below U+0800: two UTF-8 bytes
      out += static_cast<char>(0xC0 | (u >> 6));
      out += static_cast<char>(0x80 | (u & 0x3F));
    }
  }
  return out;
}

std::string bpe_tokenizer_json(const BpeModel& model) {
  using ojson = nlohmann::ordered_json;
  ojson added = ojson::array();
  for (size_t i = 0; i < model.special_tokens.size(); ++i)
    added.push_back({{"id", model.first_special_id() + static_cast<int32_t>(i)},
                     {"content", model.special_tokens[i]},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});

  ojson vocab = ojson::object();
  for (size_t id = 0; id < model.tokens.size(); ++id) vocab[bytes_to_unicode(model.tokens[id])] = id;
  ojson merges = ojson::array();
  for (const auto& [a, b] : model.merges)
    merges.push_back(bytes_to_unicode(model.tokens[static_cast<size_t>(a)]) + " " +
                     bytes_to_unicode(model.tokens[static_cast<size_t>(b)]));

  // Llama 3's layout: split with the regex, then the byte-to-character mapping
  // (without its own regex) so the BPE model sees the vocabulary's alphabet.
  ojson pre = {{"type", "Sequence"},
               {"pretokenizers",
                ojson::array({ojson{{"type", "Split"},
                                    {"pattern", {{"Regex", model.pattern}}},
                                    {"behavior", "Isolated"},
                                    {"invert", false}},
                              ojson{{"type", "ByteLevel"},
                                    {"add_prefix_space", false},
                                    {"trim_offsets", true},
                                    {"use_regex", false}}})}};

  // Llama 3 puts BOS before every sequence; the first special token is BOS.
  ojson post = nullptr;
  if (!model.special_tokens.empty()) {
    const std::string& bos = model.special_tokens[0];
    const int32_t bos_id = model.first_special_id();
    post = {{"type", "TemplateProcessing"},
            {"single", ojson::array({ojson{{"SpecialToken", {{"id", bos}, {"type_id", 0}}}},
                                     ojson{{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
            {"pair", ojson::array({ojson{{"SpecialToken", {{"id", bos}, {"type_id", 0}}}},
                                   ojson{{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
                                   ojson{{"SpecialToken", {{"id", bos}, {"type_id", 1}}}},
                                   ojson{{"Sequence", {{"id", "B"}, {"type_id", 1}}}}})},
            {"special_tokens", {{bos, {{"id", bos}, {"ids", {bos_id}}, {"tokens", {bos}}}}}}};
  }

  ojson j = {{"version", "1.0"},
             {"truncation", nullptr},
             {"padding", nullptr},
             {"added_tokens", added},
             {"normalizer", nullptr},
             {"pre_tokenizer", pre},
             {"post_processor", post},
             {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
             {"model",
              {{"type", "BPE"},
               {"dropout", nullptr},
               {"unk_token", nullptr},
               {"continuing_subword_prefix", nullptr},
               {"end_of_word_suffix", nullptr},
               {"fuse_unk", false},
               {"byte_fallback", false},
               {"ignore_merges", false},
               {"vocab", vocab},
               {"merges", merges}}}};
  return j.dump(2) + "\n";
}

void write_bpe_tokenizer_json(const BpeModel& model, const std::string& path) {
  namespace fs = std::filesystem;
  const std::string text = bpe_tokenizer_json(model);
  const fs::path target(path);
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  ANVIL_CHECK(fs::is_directory(dir), "cannot write '", path, "': folder '", dir.string(),
              "' does not exist; create it first");
  const std::string tmp = path + ".tmp." + std::to_string(getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    ANVIL_CHECK(out.good(), "cannot open '", tmp, "' for writing; check the folder's permissions");
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    out.flush();
    if (!out.good()) {
      out.close();
      std::remove(tmp.c_str());
      throw Error(detail::concat("writing '", tmp, "' failed (disk full?)"));
    }
  }
  std::error_code ec;
  fs::rename(tmp, target, ec);
  if (ec) {
    std::remove(tmp.c_str());
    throw Error(detail::concat("cannot rename '", tmp, "' to '", path, "': ", ec.message()));
  }
}

}  // namespace anvil
