#define PCRE2_CODE_UNIT_WIDTH 8
#include "anvil/data/pretokenizer.h"

#include <pcre2.h>

#include "anvil/core/error.h"

namespace anvil {

namespace {

std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  pcre2_get_error_message(code, buf, sizeof buf);
  return reinterpret_cast<const char*>(buf);
}

// Match data and the JIT stack belong to one thread at a time, so each thread
// keeps its own. The JIT's default 32 KiB stack overflows on look-ahead over
// long whitespace runs; 64 MiB covers runs of millions of characters.
struct ThreadMatchState {
  pcre2_match_data* data = nullptr;
  pcre2_match_context* context = nullptr;
  pcre2_jit_stack* stack = nullptr;
  ThreadMatchState() {
    // One pair is enough: only the whole match is used. With more capture
    // groups than pairs PCRE2 returns 0 and still fills the first pair.
    data = pcre2_match_data_create(1, nullptr);
    context = pcre2_match_context_create(nullptr);
    stack = pcre2_jit_stack_create(32 * 1024, 64 * 1024 * 1024, nullptr);
    ANVIL_ASSERT(data && context && stack, "out of memory creating PCRE2 match state");
    pcre2_jit_stack_assign(context, nullptr, stack);
  }
  ~ThreadMatchState() {
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(context);
    pcre2_match_data_free(data);
  }
};

ThreadMatchState& thread_match_state() {
  thread_local ThreadMatchState state;
  return state;
}

// Length of the (possibly invalid) UTF-8 sequence starting at text[i], used
// only to step past an empty match without splitting a character.
size_t char_length(std::string_view text, size_t i) {
  const unsigned char c = static_cast<unsigned char>(text[i]);
  size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
  for (size_t k = 1; k < n; ++k)
    if (i + k >= text.size() || (static_cast<unsigned char>(text[i + k]) & 0xC0) != 0x80) return 1;
  return n;
}

}  // namespace

RegexSplitter::RegexSplitter(const std::string& pattern) : pattern_(pattern) {
  int err = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &err, &offset,
                                   nullptr);
  ANVIL_CHECK(code != nullptr, "pre-tokenizer pattern does not compile: ", pcre2_message(err),
              " at offset ", offset, " of /", pattern, "/; fix the pattern in the tokenizer file");
  code_ = code;
  // Without JIT support (some builds of PCRE2) the interpreter gives the same
  // matches, only slower.
  jit_ = pcre2_jit_compile(code, PCRE2_JIT_COMPLETE) == 0;
}

RegexSplitter::~RegexSplitter() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

void RegexSplitter::split(std::string_view text, std::vector<std::string_view>& pieces) const {
  auto* code = static_cast<pcre2_code*>(code_);
  ThreadMatchState& st = thread_match_state();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t pos = 0;   // where the next search starts
  size_t kept = 0;  // end of the text already handed out as pieces
  while (pos < text.size()) {
    // MATCH_INVALID_UTF makes PCRE2 skip its up-front UTF check, which would
    // otherwise rescan the whole subject on every call.
    const int rc = jit_ ? pcre2_jit_match(code, subject, text.size(), pos, 0, st.data, st.context)
                        : pcre2_match(code, subject, text.size(), pos, 0, st.data, st.context);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    ANVIL_CHECK(rc >= 0, "pre-tokenizer pattern failed at byte ", pos, " of a ", text.size(),
                "-byte text: ", pcre2_message(rc), " (pattern /", pattern_, "/)");
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(st.data);
    const size_t start = ov[0], end = ov[1];
    if (start > kept) pieces.push_back(text.substr(kept, start - kept));  // unmatched bytes
    if (end > start) {
      pieces.push_back(text.substr(start, end - start));
      kept = end;
      pos = end;
    } else {
      // An empty match yields no piece; step one character so the search moves on.
      kept = start;
      pos = start + char_length(text, start);
    }
  }
  if (kept < text.size()) pieces.push_back(text.substr(kept));
}

void Pretokenizer::split(std::string_view text, std::vector<std::string_view>& pieces) const {
  pieces.clear();
  if (text.empty()) return;
  if (stages_.empty()) {
    pieces.push_back(text);
    return;
  }
  stages_[0]->split(text, pieces);
  std::vector<std::string_view> next;
  for (size_t s = 1; s < stages_.size(); ++s) {
    next.clear();
    for (std::string_view p : pieces) stages_[s]->split(p, next);
    pieces.swap(next);
  }
}

}  // namespace anvil
