// Byte-level BPE on hand-made vocabularies whose ids are worked out by hand,
// in both file formats; special tokens; round trips on every kind of text;
// invalid UTF-8; and the errors a user meets with a bad file.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "anvil/core/error.h"
#include "anvil/data/bpe_tokenizer.h"
#include "anvil/data/pretokenizer.h"
#include "test_util.h"

namespace fs = std::filesystem;
using anvil::BpeTokenizer;
using Ids = std::vector<int32_t>;

namespace {

const fs::path kDir = anvil::testing::scratch_root() / "anvil_tokenizer_test";

// GPT-2's byte alphabet, written out again here (not taken from the code under
// test): printable Latin-1 bytes are themselves, the rest count up from U+0100.
std::string byte_char(int b) {
  static std::vector<std::string> table = [] {
    std::vector<std::string> t(256);
    int next = 256;
    for (int c = 0; c < 256; ++c) {
      const bool printable = (c >= 33 && c <= 126) || (c >= 161 && c <= 172) || c >= 174;
      const int cp = printable ? c : next++;
      std::string s;
      if (cp < 0x80) {
        s.push_back(static_cast<char>(cp));
      } else {
        s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
        s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
      }
      t[c] = s;
    }
    return t;
  }();
  return table[b];
}

// The hand-made vocabulary: ids 0-255 are the bytes, then these merges in
// rank order ("Ġ" is the alphabet's space), then two special tokens.
const std::vector<std::pair<std::string, std::string>> kMerges = {
    {"h", "e"},     {"l", "l"},   {"he", "ll"}, {"hell", "o"}, {"Ġ", "w"}, {"o", "r"},
    {"Ġw", "or"}, {"Ġwor", "l"}, {"Ġworl", "d"}, {"a", "a"},  {"Ġ", "Ġ"}, {"e", "l"}};
constexpr int32_t kHello = 259, kWorld = 264, kAA = 265, kLL = 257, kBos = 268, kEos = 269;

std::string write(const std::string& name, const std::string& content) {
  fs::create_directories(kDir);
  const fs::path p = kDir / name;
  std::ofstream(p, std::ios::binary) << content;
  return p.string();
}

nlohmann::json hf_json(bool pair_merges) {
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_char(b)] = b;
  nlohmann::json merges = nlohmann::json::array();
  int id = 256;
  for (const auto& [l, r] : kMerges) {
    vocab[l + r] = id++;
    if (pair_merges)
      merges.push_back({l, r});
    else
      merges.push_back(l + " " + r);
  }
  nlohmann::json j;
  j["version"] = "1.0";
  j["added_tokens"] = {{{"id", kBos}, {"content", "<|begin_of_text|>"}, {"special", true}},
                       {{"id", kEos}, {"content", "<|end_of_text|>"}, {"special", true}}};
  j["normalizer"] = nullptr;
  j["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       {{{"type", "Split"}, {"pattern", {{"Regex", anvil::kLlama3Pattern}}}, {"behavior", "Isolated"}, {"invert", false}},
        {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}};
  j["model"] = {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}};
  return j;
}

std::string tiktoken_file() {
  static const char* b64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  auto encode64 = [](const std::string& s) {
    std::string out;
    for (size_t i = 0; i < s.size(); i += 3) {
      uint32_t v = static_cast<unsigned char>(s[i]) << 16;
      if (i + 1 < s.size()) v |= static_cast<unsigned char>(s[i + 1]) << 8;
      if (i + 2 < s.size()) v |= static_cast<unsigned char>(s[i + 2]);
      out += b64[(v >> 18) & 63];
      out += b64[(v >> 12) & 63];
      out += i + 1 < s.size() ? b64[(v >> 6) & 63] : '=';
      out += i + 2 < s.size() ? b64[v & 63] : '=';
    }
    return out;
  };
  std::string text;
  for (int b = 0; b < 256; ++b) text += encode64(std::string(1, static_cast<char>(b))) + " " + std::to_string(b) + "\n";
  int rank = 256;
  for (const auto& [l, r] : kMerges) {
    // "Ġ" (0xC4 0xA0) stands for the space byte.
    const std::string mapped = l + r;
    std::string bytes;
    for (size_t i = 0; i < mapped.size(); ++i) {
      const bool space = mapped.compare(i, 2, "Ġ") == 0;
      bytes.push_back(space ? ' ' : mapped[i]);
      i += space;
    }
    text += encode64(bytes) + " " + std::to_string(rank++) + "\n";
  }
  return text;
}

std::unique_ptr<BpeTokenizer> hf(bool pair_merges = false) {
  return BpeTokenizer::load(write(pair_merges ? "pairs.json" : "strings.json", hf_json(pair_merges).dump()));
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const anvil::Error& e) {
    return e.what();
  }
  return "(no error)";
}

// Text of every kind the round trip must survive.
const std::vector<std::string> kTexts = {
    "",
    "hello world",
    "The quick brown fox jumps over the lazy dog. It's 3:14 p.m., isn't it? We'll see; they'd know.",
    "int main(int argc, char** argv) {\n\tfor (int i = 0; i < argc; ++i) printf(\"%s\\n\", argv[i]);\n}\n",
    "3.14159 2653589793 1,000,000 -42 0x7fff 1e-9",
    "   leading  and   trailing   \n\n\n\t\t  \r\n  ",
    "emoji 🦙🔥👍🏽 and 👨‍👩‍👧‍👦 family",
    "中文文本，日本語のテキスト、한국어 텍스트",
    "Ça va? Élève, naïve façade, São Paulo, Zürich, Ångström, ĳ, ß",
    "<|begin_of_text|>special<|end_of_text|> and <|not_special|>",
};

}  // namespace

TEST(Tokenizer, HandComputedIdsFromTokenizerJson) {
  for (bool pairs : {false, true}) {
    SCOPED_TRACE(pairs ? "merges as [a, b] pairs" : "merges as \"a b\" strings");
    auto t = hf(pairs);
    EXPECT_EQ(t->vocab_size(), 270);
    EXPECT_EQ(t->bos_id(), kBos);
    EXPECT_EQ(t->eos_id(), kEos);
    EXPECT_EQ(t->encode(""), Ids{});
    EXPECT_EQ(t->encode("hello world"), (Ids{kHello, kWorld}));
    // Two spaces: the first is its own piece (\s+(?!\S)), the second joins "world".
    EXPECT_EQ(t->encode("hello  world"), (Ids{kHello, ' ', kWorld}));
    // Equal ranks merge leftmost first: a a a -> aa a.
    EXPECT_EQ(t->encode("aaa"), (Ids{kAA, 'a'}));
    EXPECT_EQ(t->encode("aaaa"), (Ids{kAA, kAA}));
    // The lower rank wins over the leftmost pair: "ll" (257) before "el" (267).
    EXPECT_EQ(t->encode("ell"), (Ids{'e', kLL}));
    // Contractions and digits are pieces of their own; digits go in threes.
    EXPECT_EQ(t->encode("it's"), (Ids{'i', 't', '\'', 's'}));
    EXPECT_EQ(t->encode("12345"), (Ids{'1', '2', '3', '4', '5'}));
    // Special tokens are matched in the text before pre-tokenization.
    EXPECT_EQ(t->encode("<|begin_of_text|>hello<|end_of_text|>"), (Ids{kBos, kHello, kEos}));
    EXPECT_EQ(t->decode({kBos, kHello, kWorld, kEos}), "<|begin_of_text|>hello world<|end_of_text|>");
    EXPECT_TRUE(t->is_special(kBos));
    EXPECT_FALSE(t->is_special(kHello));
    EXPECT_EQ(t->token_id(" world"), kWorld);
  }
}

TEST(Tokenizer, TiktokenGivesTheSameIds) {
  auto t = BpeTokenizer::load(write("small.tiktoken", tiktoken_file()));
  // The 256 Llama 3 special tokens follow the 268 ordinary ones.
  EXPECT_EQ(t->vocab_size(), 268 + 256);
  EXPECT_EQ(t->bos_id(), 268);
  EXPECT_EQ(t->eos_id(), 269);
  EXPECT_EQ(t->token_id("<|start_header_id|>"), 268 + 6);
  EXPECT_EQ(t->token_id("<|eot_id|>"), 268 + 9);
  EXPECT_EQ(t->token_id("<|reserved_special_token_250|>"), 268 + 255);
  EXPECT_EQ(t->encode("hello world"), (Ids{kHello, kWorld}));
  EXPECT_EQ(t->encode("hello  world"), (Ids{kHello, ' ', kWorld}));
  EXPECT_EQ(t->encode("aaa"), (Ids{kAA, 'a'}));
  EXPECT_EQ(t->encode("ell"), (Ids{'e', kLL}));
  EXPECT_EQ(t->encode("<|begin_of_text|>hello<|eot_id|>"), (Ids{268, kHello, 268 + 9}));
  auto h = hf();
  for (const std::string& s : kTexts) {
    if (s.find("<|") != std::string::npos) continue;  // the two files' special tokens differ
    EXPECT_EQ(t->encode(s), h->encode(s)) << s;
  }
}

TEST(Tokenizer, SpecialTokensCanBeOrdinaryText) {
  BpeTokenizer::Options opt;
  opt.match_special_tokens = false;
  auto t = BpeTokenizer::load(write("strings.json", hf_json(false).dump()), opt);
  const Ids ids = t->encode("<|end_of_text|>");
  EXPECT_GT(ids.size(), 1u);
  for (int32_t id : ids) EXPECT_FALSE(t->is_special(id));
  EXPECT_EQ(t->decode(ids), "<|end_of_text|>");
}

TEST(Tokenizer, IgnoreMergesTakesAWholePieceThatIsAToken) {
  // "zz" is in the vocabulary but no merge builds it.
  nlohmann::json j = hf_json(false);
  j["model"]["vocab"]["zz"] = 270;
  EXPECT_EQ(BpeTokenizer::load(write("no_ignore.json", j.dump()))->encode("zz"), (Ids{'z', 'z'}));
  j["model"]["ignore_merges"] = true;
  EXPECT_EQ(BpeTokenizer::load(write("ignore.json", j.dump()))->encode("zz"), (Ids{270}));
}

TEST(Tokenizer, GptTwoStyleByteLevelPreTokenizer) {
  nlohmann::json j = hf_json(false);
  j["pre_tokenizer"] = {{"type", "ByteLevel"}, {"add_prefix_space", true}};
  auto t = BpeTokenizer::load(write("gpt2.json", j.dump()));
  // add_prefix_space turns "world" into " world".
  EXPECT_EQ(t->encode("world"), (Ids{kWorld}));
  EXPECT_EQ(t->decode(t->encode("world")), " world");
}

TEST(Tokenizer, RoundTripsEveryKindOfText) {
  auto t = hf();
  auto k = BpeTokenizer::load(write("small.tiktoken", tiktoken_file()));
  for (const std::string& s : kTexts) {
    EXPECT_EQ(t->decode(t->encode(s)), s);
    EXPECT_EQ(k->decode(k->encode(s)), s);
  }
  // Long runs: one 5000-letter piece and a 200,000-space run before a word
  // (look-ahead over a long run needs the enlarged JIT stack).
  const std::string letters(5000, 'a');
  EXPECT_EQ(t->encode(letters), Ids(2500, kAA));
  const std::string spaces = std::string(200000, ' ') + "hello";
  EXPECT_EQ(t->decode(t->encode(spaces)), spaces);
}

TEST(Tokenizer, InvalidUtf8IsEncodedByteByByte) {
  // Invalid sequences match no pattern item (PCRE2_MATCH_INVALID_UTF), so each
  // becomes a piece of its own and encodes to its byte tokens; decode gives
  // the same bytes back.
  auto t = hf();
  EXPECT_EQ(t->encode("a\xff" "b"), (Ids{'a', 0xFF, 'b'}));
  EXPECT_EQ(t->encode("hello\xc3"), (Ids{kHello, 0xC3}));  // truncated 2-byte sequence
  const std::vector<std::string> bad = {"\xff\xfe", "\xc3", "abc\xe2\x82", "\xed\xa0\x80 surrogate",
                                        "\xf4\x90\x80\x80 too big", "\xc0\xaf overlong", "mixed \x80 é \xbf 🦙 \xf0\x9f"};
  for (const std::string& s : bad) EXPECT_EQ(t->decode(t->encode(s)), s);
  std::vector<std::string_view> pieces;
  anvil::RegexSplitter split(anvil::kLlama3Pattern);
  split.split("x\xff\xfe y", pieces);
  EXPECT_EQ(pieces, (std::vector<std::string_view>{"x", "\xff\xfe", " y"}));
}

TEST(Tokenizer, EncodesConcurrently) {
  auto t = hf();
  std::vector<Ids> expect;
  for (const std::string& s : kTexts) expect.push_back(t->encode(s));
  std::vector<int> bad(4, 0);
  std::vector<std::thread> threads;
  for (int w = 0; w < 4; ++w)
    threads.emplace_back([&, w] {
      for (int r = 0; r < 50; ++r)
        for (size_t i = 0; i < kTexts.size(); ++i) bad[w] += t->encode(kTexts[i]) != expect[i];
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad, std::vector<int>(4, 0));
}

TEST(Tokenizer, ClearErrorsForBadFiles) {
  EXPECT_NE(error_of([] { BpeTokenizer::load((kDir / "missing.json").string()); }).find("does not exist"),
            std::string::npos);
  EXPECT_NE(error_of([] { BpeTokenizer::load(write("bad.json", "{\"model\": {\"type\": \"BPE\",}")); })
                .find("not valid JSON"),
            std::string::npos);
  nlohmann::json j = hf_json(false);
  j["model"]["type"] = "WordPiece";
  EXPECT_NE(error_of([&] { BpeTokenizer::load(write("wordpiece.json", j.dump())); }).find("\"WordPiece\""),
            std::string::npos);
  j = hf_json(false);
  j["model"]["merges"].push_back("q nonexistent");
  EXPECT_NE(error_of([&] { BpeTokenizer::load(write("badmerge.json", j.dump())); }).find("model.merges[12]"),
            std::string::npos);
  j = hf_json(false);
  j["model"]["vocab"].erase(byte_char(7));
  EXPECT_NE(error_of([&] { BpeTokenizer::load(write("nobyte.json", j.dump())); }).find("byte 0x7"),
            std::string::npos);
  j = hf_json(false);
  j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed";
  EXPECT_NE(error_of([&] { BpeTokenizer::load(write("badregex.json", j.dump())); }).find("does not compile"),
            std::string::npos);
  EXPECT_NE(error_of([] { BpeTokenizer::load(write("bad.tiktoken", "IQ== 0\nIg== 1\nnot base64! x\n")); })
                .find("bad.tiktoken:3:"),
            std::string::npos);
  EXPECT_NE(error_of([] { BpeTokenizer::load(write("empty.tiktoken", "")); }).find("holds no tokens"),
            std::string::npos);
  auto t = hf();
  EXPECT_NE(error_of([&] { t->decode({kHello, 270}); }).find("token id 270 is not in the vocabulary"),
            std::string::npos);
  EXPECT_NE(error_of([&] { t->decode({-1}); }).find("token id -1"), std::string::npos);
}

// `anvil tokenizer encode|decode`, once the lead has wired the command in.
TEST(Tokenizer, CommandLine) {
  auto run = [](const std::string& args, const std::string& input) {
    const std::string in = write("cli_in.txt", input);
    const std::string cmd = std::string(ANVIL_BINARY) + " tokenizer " + args + " < " + in + " 2>&1";
    std::string out;
    FILE* p = popen(cmd.c_str(), "r");
    char buf[4096];
    for (size_t n; (n = fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
    const int status = pclose(p);
    return std::make_pair(WIFEXITED(status) ? WEXITSTATUS(status) : -1, out);
  };
  // The command exists and answers --help: a broken binary or a missing
  // command fails here, with its output, rather than passing unseen.
  const auto help = run("--help", "");
  ASSERT_EQ(help.first, 0) << "`anvil tokenizer --help` failed:\n" << help.second;
  EXPECT_NE(help.second.find("usage: anvil tokenizer encode"), std::string::npos) << help.second;
  const std::string path = write("strings.json", hf_json(false).dump());
  EXPECT_EQ(run("encode --tokenizer " + path, "hello world"), std::make_pair(0, std::string("259 264\n")));
  EXPECT_EQ(run("encode --tokenizer " + path + " --bos --eos", "hello world"),
            std::make_pair(0, std::string("268 259 264 269\n")));
  EXPECT_EQ(run("decode --tokenizer " + path, "268 259 264\n"),
            std::make_pair(0, std::string("<|begin_of_text|>hello world")));
  auto bad = run("decode --tokenizer " + path, "259 99999");
  EXPECT_EQ(bad.first, 1);
  EXPECT_NE(bad.second.find("99999"), std::string::npos);
  bad = run("frobnicate", "");
  EXPECT_EQ(bad.first, 2);
  EXPECT_NE(bad.second.find("unknown sub-command"), std::string::npos);
}
