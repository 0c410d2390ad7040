// The byte-level BPE trainer: hand-checked merges, agreement with a naive
// recount-everything trainer, determinism, the tokenizer.json layout, encode
// and decode round trips, and the errors a user can cause.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "anvil/core/error.h"
#include "anvil/data/bpe_tokenizer.h"
#include "anvil/data/bpe_trainer.h"

#include "anvil/cli/tokenizer_train_cmd.h"
#include "test_util.h"

namespace fs = std::filesystem;
using anvil::testing::error_of;
using anvil::BpeModel;
using anvil::BpeTrainOptions;

namespace {

std::string tok(const BpeModel& m, int32_t id) { return m.tokens.at(static_cast<size_t>(id)); }

// Text with a Zipf-like spread of made-up words, punctuation, numbers and
// newlines: enough distinct pairs for a few thousand merges.
std::string generated_text(int words, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::string> lexicon;
  const std::string letters = "etaoinshrdlcumwfgypbvkjxqz";
  for (int i = 0; i < 3000; ++i) {
    std::string w;
    const int len = 2 + static_cast<int>(rng() % 9);
    for (int k = 0; k < len; ++k) w += letters[std::min<size_t>(rng() % 26, rng() % 26)];
    if (rng() % 7 == 0) w[0] = static_cast<char>(w[0] - 'a' + 'A');
    lexicon.push_back(w);
  }
  std::string text;
  for (int i = 0; i < words; ++i) {
    const size_t r = rng() % lexicon.size();
    text += lexicon[std::min(r, static_cast<size_t>(rng() % lexicon.size()))];
    const uint32_t p = rng() % 40;
    if (p == 0) text += ", ";
    else if (p == 1) text += ".\n";
    else if (p == 2) text += " " + std::to_string(rng() % 5000) + " ";
    else text += ' ';
  }
  return text;
}

// The textbook trainer: recount every pair before every merge. Same tie rule.
std::vector<std::pair<int32_t, int32_t>> naive_merges(const std::unordered_map<std::string, int64_t>& counts,
                                                      int64_t n_merges) {
  std::vector<std::pair<std::vector<int32_t>, int64_t>> words;
  for (const auto& [w, c] : counts) {
    std::vector<int32_t> s;
    for (unsigned char ch : w) s.push_back(ch);
    words.push_back({s, c});
  }
  std::vector<std::pair<int32_t, int32_t>> merges;
  for (int64_t m = 0; m < n_merges; ++m) {
    std::map<std::pair<int32_t, int32_t>, int64_t> pairs;
    for (const auto& [s, c] : words)
      for (size_t i = 0; i + 1 < s.size(); ++i) pairs[{s[i], s[i + 1]}] += c;
    if (pairs.empty()) break;
    auto best = pairs.begin();  // std::map is ordered by pair: the first of the highest counts wins ties
    for (auto it = pairs.begin(); it != pairs.end(); ++it)
      if (it->second > best->second) best = it;
    const auto [a, b] = best->first;
    const int32_t id = 256 + static_cast<int32_t>(m);
    merges.push_back({a, b});
    for (auto& [s, c] : words) {
      std::vector<int32_t> out;
      for (size_t i = 0; i < s.size();) {
        if (i + 1 < s.size() && s[i] == a && s[i + 1] == b) {
          out.push_back(id);
          i += 2;
        } else {
          out.push_back(s[i++]);
        }
      }
      s = out;
    }
  }
  return merges;
}

// A minimal encoder for the trained model: pre-tokenize, then in each piece
// apply the lowest-ranked adjacent merge until none applies.
std::vector<int32_t> encode(const BpeModel& m, const std::string& text) {
  std::map<std::pair<int32_t, int32_t>, int32_t> rank;
  for (size_t i = 0; i < m.merges.size(); ++i) rank[m.merges[i]] = static_cast<int32_t>(i);
  anvil::WordCounter splitter(m.pattern);
  std::vector<int32_t> ids;
  splitter.split(text, [&](std::string_view piece) {
    std::vector<int32_t> s;
    for (unsigned char c : piece) s.push_back(c);
    while (s.size() > 1) {
      int32_t best = INT32_MAX;
      size_t at = 0;
      for (size_t i = 0; i + 1 < s.size(); ++i)
        if (auto it = rank.find({s[i], s[i + 1]}); it != rank.end() && it->second < best) best = it->second, at = i;
      if (best == INT32_MAX) break;
      s[at] = 256 + best;
      s.erase(s.begin() + static_cast<std::ptrdiff_t>(at) + 1);
    }
    ids.insert(ids.end(), s.begin(), s.end());
  });
  return ids;
}

std::string decode(const BpeModel& m, const std::vector<int32_t>& ids) {
  std::string out;
  for (int32_t id : ids) out += id < m.first_special_id() ? tok(m, id) : m.special_tokens.at(static_cast<size_t>(id - m.first_special_id()));
  return out;
}

BpeTrainOptions with_vocab(int64_t n) {
  BpeTrainOptions o;
  o.vocab_size = n;
  return o;
}


}  // namespace

TEST(BpeTrainer, HandCheckedMerges) {
  // Words "aaab" and " aaab". Pairs: (a,a) 4, (a,b) 2, (' ',a) 1, so (a,a)
  // first; "aaab" becomes aa a b, leaving (aa,a) 2 and (a,b) 2: a tie that
  // goes to the smaller ids, (97,98) = "ab". Then (aa,ab) 2, then (' ',aaab) 1.
  const BpeModel m = anvil::train_bpe(std::vector<std::string>{"aaab aaab"}, with_vocab(256 + 4 + 2));
  ASSERT_EQ(m.merges.size(), 4u);
  EXPECT_EQ(m.merges[0], std::make_pair(int32_t{'a'}, int32_t{'a'}));
  EXPECT_EQ(m.merges[1], std::make_pair(int32_t{'a'}, int32_t{'b'}));
  EXPECT_EQ(m.merges[2], std::make_pair(256, 257));
  EXPECT_EQ(m.merges[3], std::make_pair(int32_t{' '}, 258));
  EXPECT_EQ(tok(m, 256), "aa");
  EXPECT_EQ(tok(m, 257), "ab");
  EXPECT_EQ(tok(m, 258), "aaab");
  EXPECT_EQ(tok(m, 259), " aaab");
  EXPECT_EQ(m.vocab_size(), 262);
  EXPECT_EQ(m.first_special_id(), 260);
  EXPECT_EQ(m.special_tokens, (std::vector<std::string>{"<|begin_of_text|>", "<|end_of_text|>"}));

  // One more token than the text supports: a clear error naming the limit.
  const std::string err = error_of([] { anvil::train_bpe(std::vector<std::string>{"aaab aaab"}, with_vocab(263)); });
  EXPECT_NE(err.find("only 4 merges"), std::string::npos) << err;
  EXPECT_NE(err.find("--vocab-size 262"), std::string::npos) << err;
}

TEST(BpeTrainer, RepeatedSymbolsMergeLeftToRight) {
  // "aaaaa": (a,a) -> aa aa a; then (aa,aa) 1 and (aa,a) 1 tie, and the
  // smaller pair (256,97) wins over (256,256).
  BpeTrainOptions o = with_vocab(256 + 3);
  o.special_tokens = {"<|end_of_text|>"};
  const BpeModel m = anvil::train_bpe(std::vector<std::string>{"aaaaa"}, o);
  ASSERT_EQ(m.merges.size(), 2u);
  EXPECT_EQ(m.merges[0], std::make_pair(int32_t{'a'}, int32_t{'a'}));
  EXPECT_EQ(m.merges[1], std::make_pair(256, int32_t{'a'}));
  EXPECT_EQ(tok(m, 257), "aaa");

  // "ababab" twice: ab ab ab, then (ab,ab) 4 -> abab ab, then (abab,ab) 2.
  const BpeModel n = anvil::train_bpe(std::vector<std::string>{"ababab\nababab"}, with_vocab(256 + 3 + 2));
  ASSERT_EQ(n.merges.size(), 3u);
  EXPECT_EQ(tok(n, 256), "ab");
  EXPECT_EQ(tok(n, 257), "abab");
  EXPECT_EQ(tok(n, 258), "ababab");
}

TEST(BpeTrainer, AgreesWithNaiveRecount) {
  anvil::WordCounter counter;
  counter.add_text(generated_text(20000, 7));
  counter.add_text("aaaa aaaaaa abab ababab abababab xxyxxyxxy \xff\xfe\xff \xe4\xb8\xad\xe6\x96\x87 caf\xc3\xa9");
  const int64_t n_merges = 400;
  const BpeModel m = anvil::train_bpe(counter.counts(), with_vocab(256 + n_merges + 2));
  const auto expected = naive_merges(counter.counts(), n_merges);
  ASSERT_EQ(m.merges.size(), expected.size());
  for (size_t i = 0; i < expected.size(); ++i) ASSERT_EQ(m.merges[i], expected[i]) << "merge " << i;
}

TEST(BpeTrainer, DeterministicWhateverTheTextOrder) {
  std::vector<std::string> docs;
  for (uint32_t s = 0; s < 6; ++s) docs.push_back(generated_text(3000, s));
  const std::string a = anvil::bpe_tokenizer_json(anvil::train_bpe(docs, with_vocab(1000)));
  const std::string b = anvil::bpe_tokenizer_json(anvil::train_bpe(docs, with_vocab(1000)));
  std::reverse(docs.begin(), docs.end());
  const std::string c = anvil::bpe_tokenizer_json(anvil::train_bpe(docs, with_vocab(1000)));
  EXPECT_EQ(a, b);
  EXPECT_EQ(a, c);
}

TEST(BpeTrainer, TokenizerJsonLayout) {
  const int64_t vocab = 2048;
  const BpeModel m = anvil::train_bpe(std::vector<std::string>{generated_text(60000, 1)}, with_vocab(vocab));
  ASSERT_EQ(m.vocab_size(), vocab);
  ASSERT_EQ(m.merges.size(), static_cast<size_t>(vocab - 256 - 2));
  const auto j = nlohmann::json::parse(anvil::bpe_tokenizer_json(m));

  EXPECT_EQ(j["version"], "1.0");
  ASSERT_EQ(j["added_tokens"].size(), 2u);
  EXPECT_EQ(j["added_tokens"][0]["id"], 2046);
  EXPECT_EQ(j["added_tokens"][0]["content"], "<|begin_of_text|>");
  EXPECT_EQ(j["added_tokens"][1]["id"], 2047);
  EXPECT_EQ(j["added_tokens"][1]["content"], "<|end_of_text|>");
  EXPECT_TRUE(j["added_tokens"][1]["special"].get<bool>());

  const auto& split = j["pre_tokenizer"]["pretokenizers"][0];
  EXPECT_EQ(split["type"], "Split");
  EXPECT_EQ(split["pattern"]["Regex"], anvil::kLlama3PreTokenizerPattern);
  EXPECT_EQ(split["behavior"], "Isolated");
  EXPECT_EQ(split["invert"], false);
  EXPECT_EQ(j["pre_tokenizer"]["pretokenizers"][1]["type"], "ByteLevel");
  EXPECT_EQ(j["decoder"]["type"], "ByteLevel");
  EXPECT_EQ(j["model"]["type"], "BPE");

  // Vocabulary: ids 0 … 2045 exactly once, bytes first, every merge's parts
  // and result present, the result's id 256 + its rank.
  const auto& v = j["model"]["vocab"];
  ASSERT_EQ(v.size(), static_cast<size_t>(vocab - 2));
  std::set<int64_t> ids;
  for (const auto& [s, id] : v.items()) ids.insert(id.get<int64_t>());
  EXPECT_EQ(ids.size(), v.size());
  EXPECT_EQ(*ids.begin(), 0);
  EXPECT_EQ(*ids.rbegin(), vocab - 3);
  for (int b = 0; b < 256; ++b) EXPECT_EQ(v.at(anvil::bytes_to_unicode(std::string(1, static_cast<char>(b)))), b);
  const auto& merges = j["model"]["merges"];
  ASSERT_EQ(merges.size(), m.merges.size());
  for (size_t i = 0; i < merges.size(); ++i) {
    const std::string line = merges[i];
    const size_t sp = line.find(' ');
    ASSERT_NE(sp, std::string::npos);
    ASSERT_EQ(line.find(' ', sp + 1), std::string::npos) << line;  // byte-level strings hold no space
    const std::string left = line.substr(0, sp), right = line.substr(sp + 1);
    ASSERT_TRUE(v.contains(left)) << line;
    ASSERT_TRUE(v.contains(right)) << line;
    ASSERT_TRUE(v.contains(left + right)) << line;
    EXPECT_EQ(v[left + right], 256 + static_cast<int64_t>(i)) << line;
  }
}

TEST(BpeTrainer, GPT2ByteAlphabet) {
  EXPECT_EQ(anvil::bytes_to_unicode(" "), "\xc4\xa0");      // Ġ U+0120
  EXPECT_EQ(anvil::bytes_to_unicode("\n"), "\xc4\x8a");     // Ċ U+010A
  EXPECT_EQ(anvil::bytes_to_unicode(std::string(1, '\0')), "\xc4\x80");  // Ā U+0100
  EXPECT_EQ(anvil::bytes_to_unicode("\xad"), "\xc5\x83");   // Ń U+0143, the last remapped byte
  EXPECT_EQ(anvil::bytes_to_unicode("\xa1"), "\xc2\xa1");   // ¡ stands for itself
  EXPECT_EQ(anvil::bytes_to_unicode("Hi!"), "Hi!");
  std::set<std::string> all;
  for (int b = 0; b < 256; ++b) all.insert(anvil::bytes_to_unicode(std::string(1, static_cast<char>(b))));
  EXPECT_EQ(all.size(), 256u);
}

TEST(BpeTrainer, EncodeDecodeRoundTrip) {
  const BpeModel m = anvil::train_bpe(std::vector<std::string>{generated_text(40000, 3)}, with_vocab(1500));
  const std::vector<std::string> texts = {
      "",
      generated_text(500, 99),
      "Hello, world!  Tabs\tand\r\nnewlines\n\n\n   trailing   ",
      "caf\xc3\xa9 na\xc3\xafve \xe4\xb8\xad\xe6\x96\x87 \xf0\x9f\x98\x80 emoji 12345678",
      "invalid \xff\xfe utf-8 \xc3 cut \xe4\xb8 off \x80",
  };
  for (const auto& t : texts) {
    const auto ids = encode(m, t);
    EXPECT_EQ(decode(m, ids), t);
    for (int32_t id : ids) EXPECT_LT(id, m.first_special_id());
  }
  // The merges compress text like the training text.
  const std::string sample = generated_text(2000, 5);
  EXPECT_LT(encode(m, sample).size() * 3, sample.size() * 2);
}

// The written file loads into Anvil's tokenizer.json reader, which then
// encodes exactly as the minimal encoder above and decodes back to the text.
TEST(BpeTrainer, RoundTripThroughTokenizerJsonLoader) {
  const BpeModel m = anvil::train_bpe(std::vector<std::string>{generated_text(40000, 21)}, with_vocab(2048));
  const fs::path path = anvil::testing::scratch_root() / "anvil_bpe_trainer_roundtrip.json";
  anvil::write_bpe_tokenizer_json(m, path.string());
  const auto t = anvil::BpeTokenizer::from_hf_json(path.string());
  EXPECT_EQ(t->vocab_size(), 2048);
  EXPECT_EQ(t->bos_id(), 2046);
  EXPECT_EQ(t->eos_id(), 2047);
  const std::vector<std::string> texts = {
      generated_text(3000, 22),
      "Hello, world!  Tabs\tand\r\nnewlines\n\n\n   trailing   ",
      "caf\xc3\xa9 na\xc3\xafve \xe4\xb8\xad\xe6\x96\x87 \xf0\x9f\x98\x80 emoji 12345678 it's I'LL",
      "invalid \xff\xfe utf-8 \xc3 cut \xe4\xb8 off \x80",
  };
  for (const auto& text : texts) {
    const auto ids = t->encode(text);
    EXPECT_EQ(ids, encode(m, text));
    EXPECT_EQ(t->decode(ids), text);
  }
  EXPECT_EQ(t->encode("<|end_of_text|>"), std::vector<int32_t>{2047});
  fs::remove(path);
}

TEST(BpeTrainer, SpecialTokensAreCutOutOfTrainingText) {
  std::string text;
  for (int i = 0; i < 200; ++i) text += "hello<|end_of_text|>world<|begin_of_text|>";
  const BpeModel m = anvil::train_bpe(std::vector<std::string>{text}, with_vocab(256 + 8 + 2));
  for (size_t id = 256; id < m.tokens.size(); ++id)
    EXPECT_EQ(m.tokens[id].find_first_of("<|>_"), std::string::npos) << m.tokens[id];
}

TEST(BpeTrainer, InvalidUtf8IsTrainedByteByByte) {
  std::string text;
  for (int i = 0; i < 50; ++i) text += "\xff\xfe\xff\xfe ok \xc3\xa9\xc3 \x80\x80 ";
  const BpeModel m = anvil::train_bpe(std::vector<std::string>{text}, with_vocab(256 + 4 + 2));
  EXPECT_EQ(m.merges.size(), 4u);
  const auto ids = encode(m, text);
  EXPECT_EQ(decode(m, ids), text);
}

TEST(BpeTrainer, BadInputErrors) {
  const std::vector<std::string> text = {"some text to train on"};
  EXPECT_NE(error_of([&] { anvil::train_bpe(text, with_vocab(257)); }).find("too small"), std::string::npos);
  EXPECT_NE(error_of([&] { anvil::train_bpe(text, with_vocab(257)); }).find("at least 258"), std::string::npos);
  EXPECT_NO_THROW(anvil::train_bpe(text, with_vocab(258)));  // bytes and specials only, no merges
  EXPECT_NE(error_of([] { anvil::train_bpe(std::vector<std::string>{}, with_vocab(300)); }).find("empty"),
            std::string::npos);
  EXPECT_NE(error_of([] { anvil::train_bpe(std::vector<std::string>{"", ""}, with_vocab(300)); }).find("empty"),
            std::string::npos);
  BpeTrainOptions dup = with_vocab(300);
  dup.special_tokens = {"<s>", "<s>"};
  EXPECT_NE(error_of([&] { anvil::train_bpe(text, dup); }).find("twice"), std::string::npos);
  BpeTrainOptions blank = with_vocab(300);
  blank.special_tokens = {""};
  EXPECT_NE(error_of([&] { anvil::train_bpe(text, blank); }).find("empty string"), std::string::npos);
  BpeTrainOptions bad_utf8 = with_vocab(300);
  bad_utf8.special_tokens = {"<\xff>"};
  EXPECT_NE(error_of([&] { anvil::train_bpe(text, bad_utf8); }).find("UTF-8"), std::string::npos);
  BpeTrainOptions bad_regex = with_vocab(300);
  bad_regex.pattern = "(unclosed";
  EXPECT_NE(error_of([&] { anvil::train_bpe(text, bad_regex); }).find("does not compile"), std::string::npos);
  // A special token spelt like a byte token would give one string two ids.
  BpeTrainOptions clash = with_vocab(256 + 1 + 1);
  clash.special_tokens = {"a"};
  EXPECT_NE(error_of([&] { anvil::train_bpe(std::vector<std::string>{"xab xab"}, clash); }).find("ordinary token"),
            std::string::npos);
}

TEST(BpeTrainerCli, TrainsAndReportsBadInput) {
  const fs::path dir = anvil::testing::scratch_root() / "anvil_bpe_trainer_test";
  fs::remove_all(dir);
  fs::create_directories(dir / "corpus" / "sub");
  std::ofstream(dir / "corpus" / "a.txt") << generated_text(5000, 11);
  std::ofstream(dir / "corpus" / "sub" / "b.txt") << generated_text(5000, 12);
  std::ofstream(dir / "corpus" / "ignored.md") << "not a .txt file";
  std::ofstream(dir / "corpus" / "empty.txt") << "";
  std::ofstream(dir / "single.txt") << generated_text(3000, 13);
  std::ofstream(dir / "empty_file.txt") << "";
  const std::string out = (dir / "tokenizer.json").string();
  const std::string corpus = (dir / "corpus").string(), single = (dir / "single.txt").string();

  ASSERT_EQ(anvil::tokenizer_train_command({"--vocab-size", "600", "--input", corpus, single, "--output", out}), 0);
  const auto j = nlohmann::json::parse(std::ifstream(out));
  EXPECT_EQ(j["model"]["vocab"].size() + j["added_tokens"].size(), 600u);
  EXPECT_EQ(j["added_tokens"][0]["id"], 598);
  for (const auto& e : fs::directory_iterator(dir))  // no temporary file left behind
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();

  // Custom special tokens take the top ids in order.
  ASSERT_EQ(anvil::tokenizer_train_command({"--vocab-size", "400", "--input", single, "--special", "<s>",
                                            "--special", "</s>", "--special", "<pad>", "--output", out}),
            0);
  const auto k = nlohmann::json::parse(std::ifstream(out));
  EXPECT_EQ(k["added_tokens"][2]["content"], "<pad>");
  EXPECT_EQ(k["added_tokens"][2]["id"], 399);

  EXPECT_EQ(anvil::tokenizer_train_command({"--vocab-size", "100", "--input", single, "--output", out}), 1);
  EXPECT_EQ(anvil::tokenizer_train_command({"--input", (dir / "missing.txt").string(), "--output", out}), 1);
  EXPECT_EQ(anvil::tokenizer_train_command({"--input", (dir / "empty_file.txt").string(), "--output", out}), 1);
  EXPECT_EQ(anvil::tokenizer_train_command({"--brown", (dir / "no_brown").string(), "--output", out}), 1);
  EXPECT_EQ(anvil::tokenizer_train_command({"--input", single, "--output", (dir / "no" / "t.json").string()}), 1);
  EXPECT_EQ(anvil::tokenizer_train_command({"--input", single}), 2);
  EXPECT_EQ(anvil::tokenizer_train_command({"--output", out}), 2);
  EXPECT_EQ(anvil::tokenizer_train_command({"--vocab-size", "12x", "--input", single, "--output", out}), 2);
  EXPECT_EQ(anvil::tokenizer_train_command({"--bogus"}), 2);
  fs::remove_all(dir);
}
