// Pre-tokenization: a regular expression cuts text into pieces ("words") that
// BPE then encodes independently, so merges never cross a piece boundary.
// Patterns are compiled by PCRE2 in UTF mode with Unicode properties (UCP), so
// \p{L}, \p{N}, \s, (?i:...) and look-ahead behave as in the Python and Rust
// references; JIT compilation keeps the split fast.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace anvil {

// GPT-2's pre-tokenizer pattern (also Hugging Face's ByteLevel with use_regex).
inline constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
// Llama 3's pattern (tiktoken, and the Split step of its tokenizer.json).
inline constexpr const char* kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// One compiled pattern. Splitting keeps every byte: each match is a piece, and
// so is any stretch between matches (Hugging Face's "Isolated" behaviour).
//
// Invalid UTF-8 never crashes: the pattern is compiled with
// PCRE2_MATCH_INVALID_UTF, under which no pattern item can match an invalid
// byte sequence. Such bytes fall between matches and become pieces of their
// own, which the byte-level BPE still encodes byte by byte.
class RegexSplitter {
 public:
  explicit RegexSplitter(const std::string& pattern);
  ~RegexSplitter();
  RegexSplitter(const RegexSplitter&) = delete;
  RegexSplitter& operator=(const RegexSplitter&) = delete;

  // Appends the pieces of `text` to `pieces` (views into `text`), in order;
  // their concatenation is `text`. Thread-safe.
  void split(std::string_view text, std::vector<std::string_view>& pieces) const;
  const std::string& pattern() const { return pattern_; }
  bool jit() const { return jit_; }

 private:
  std::string pattern_;
  void* code_ = nullptr;  // pcre2_code_8*, kept opaque so callers need not include pcre2.h
  bool jit_ = false;
};

// A chain of splitters: each one splits the pieces of the one before.
class Pretokenizer {
 public:
  void add(const std::string& pattern) { stages_.push_back(std::make_unique<RegexSplitter>(pattern)); }
  bool empty() const { return stages_.empty(); }
  // Replaces the contents of `pieces` with the pieces of `text`.
  void split(std::string_view text, std::vector<std::string_view>& pieces) const;

 private:
  std::vector<std::unique_ptr<RegexSplitter>> stages_;
};

}  // namespace anvil
