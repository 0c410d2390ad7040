// Document sources, token shards and `anvil tokenize`: every input form, every kind
// of bad input (with the file and line in the message, or skipped and counted), and
// shards that round-trip, refuse to be misread, and are never half-written.
#include <gtest/gtest.h>
#include <zlib.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "anvil/cli/tokenize_cmd.h"
#include "anvil/core/error.h"
#include "anvil/data/shard.h"
#include "anvil/data/text_source.h"
#include "anvil/data/tokenizer.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace anvil;

namespace {

fs::path fresh_dir(const std::string& name) {
  const fs::path d = anvil::testing::scratch_root() / "anvil_dataset_test" / name;
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

void write_file(const fs::path& p, const std::string& bytes) {
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary) << bytes;
}

void write_gz(const fs::path& p, const std::string& bytes) {
  gzFile f = gzopen(p.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  if (!bytes.empty()) {
    ASSERT_EQ(gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())), static_cast<int>(bytes.size()));
  }
  gzclose(f);
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::vector<std::string> all_docs(const std::vector<std::string>& inputs, SourceOptions opts = {},
                                  SourceStats* stats = nullptr) {
  DocumentSource src(inputs, opts);
  std::vector<std::string> out;
  for (std::string t; src.next(t);) out.push_back(t);
  if (stats != nullptr) *stats = src.stats();
  return out;
}

// The message of the anvil::Error that f throws ("" when none).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

const std::string kJsonl =
    "{\"text\": \"first document\", \"id\": 1}\n"
    "{\"text\": \"caf\\u00e9 \\ud83d\\ude00 \\u4e2d\\u6587\\nsecond line\", \"id\": 2}\r\n"
    "\n"
    "{\"id\": 3, \"text\": \"\"}\n"
    "{\"text\": \"no newline at the end\"}";
const std::vector<std::string> kJsonlDocs = {"first document", "caf\xC3\xA9 \xF0\x9F\x98\x80 \xE4\xB8\xAD\xE6\x96\x87\nsecond line",
                                             "", "no newline at the end"};

}  // namespace

TEST(TextSource, JsonLinesPlainAndGzip) {
  const fs::path d = fresh_dir("jsonl");
  write_file(d / "a.jsonl", kJsonl);
  write_gz(d / "b.json.gz", kJsonl);
  SourceStats stats;
  const auto docs = all_docs({(d / "a.jsonl").string(), (d / "b.json.gz").string()}, {}, &stats);
  ASSERT_EQ(docs.size(), 8u);
  for (size_t i = 0; i < 8; ++i) EXPECT_EQ(docs[i], kJsonlDocs[i % 4]) << i;
  EXPECT_EQ(stats.files, 2);
  EXPECT_EQ(stats.documents, 8);
  EXPECT_EQ(stats.skipped(), 0);
}

TEST(TextSource, ConfigurableFieldAndLongLines) {
  const fs::path d = fresh_dir("field");
  const std::string big(3 << 20, 'x');  // longer than one 1 MiB read
  write_gz(d / "c.jsonl.gz", "{\"content\": \"" + big + "\"}\n{\"content\": \"short\"}\n");
  SourceOptions o;
  o.text_field = "content";
  const auto docs = all_docs({(d / "c.jsonl.gz").string()}, o);
  ASSERT_EQ(docs.size(), 2u);
  EXPECT_EQ(docs[0], big);
  EXPECT_EQ(docs[1], "short");
}

TEST(TextSource, TextFilesDirectoriesAndGlobs) {
  const fs::path d = fresh_dir("tree");
  write_file(d / "b.txt", "bee\n");
  write_file(d / "a.txt", "ay");
  write_file(d / "sub" / "c.txt", "sea\xff\xfe");  // invalid UTF-8 passes through untouched
  write_file(d / "sub" / "d.jsonl", "{\"text\": \"dee\"}\n");
  EXPECT_EQ(all_docs({d.string()}), (std::vector<std::string>{"ay", "bee\n", "sea\xff\xfe", "dee"}));
  EXPECT_EQ(all_docs({(d / "*.txt").string()}), (std::vector<std::string>{"ay", "bee\n"}));
  EXPECT_EQ(all_docs({(d / "sub" / "*").string()}), (std::vector<std::string>{"sea\xff\xfe", "dee"}));
  // Inputs keep their order; a file named twice is read once.
  EXPECT_EQ(all_docs({(d / "b.txt").string(), (d / "?.txt").string()}), (std::vector<std::string>{"bee\n", "ay"}));
}

TEST(TextSource, EveryBadInputNamesTheFileAndLine) {
  const fs::path d = fresh_dir("bad");
  EXPECT_NE(error_of([&] { all_docs({(d / "nope.jsonl").string()}); }).find("nope.jsonl: no such file"),
            std::string::npos);
  EXPECT_NE(error_of([&] { all_docs({(d / "*.none").string()}); }).find("no file matches the pattern"),
            std::string::npos);
  write_file(d / "empty.jsonl", "");
  EXPECT_NE(error_of([&] { all_docs({(d / "empty.jsonl").string()}); }).find("empty.jsonl: the file is empty"),
            std::string::npos);
  write_file(d / "empty.txt", "");
  EXPECT_NE(error_of([&] { all_docs({(d / "empty.txt").string()}); }).find("empty.txt: the file is empty"),
            std::string::npos);
  write_gz(d / "empty.json.gz", "");
  EXPECT_NE(error_of([&] { all_docs({(d / "empty.json.gz").string()}); }).find("empty.json.gz: the file is empty"),
            std::string::npos);
  write_file(d / "syntax.jsonl", "{\"text\": \"ok\"}\n{\"text\": \"ok\"}\n{\"text\": unquoted}\n");
  const std::string syntax = error_of([&] { all_docs({(d / "syntax.jsonl").string()}); });
  EXPECT_NE(syntax.find("syntax.jsonl:3: invalid JSON"), std::string::npos) << syntax;
  EXPECT_NE(syntax.find("--skip-bad"), std::string::npos) << syntax;
  // Invalid UTF-8 inside a JSON string is invalid JSON, not a crash.
  write_file(d / "utf8.jsonl", "{\"text\": \"\xc3\x28\"}\n");
  EXPECT_NE(error_of([&] { all_docs({(d / "utf8.jsonl").string()}); }).find("utf8.jsonl:1: invalid JSON"),
            std::string::npos);
  write_file(d / "field.jsonl", "{\"text\": \"ok\"}\n{\"body\": \"no text\"}\n");
  const std::string field = error_of([&] { all_docs({(d / "field.jsonl").string()}); });
  EXPECT_NE(field.find("field.jsonl:2: no string field \"text\""), std::string::npos) << field;
  write_file(d / "number.jsonl", "{\"text\": 5}\n");
  EXPECT_NE(error_of([&] { all_docs({(d / "number.jsonl").string()}); }).find("number.jsonl:1: no string field"),
            std::string::npos);
  write_file(d / "array.jsonl", "[\"text\"]\n");
  EXPECT_NE(error_of([&] { all_docs({(d / "array.jsonl").string()}); }).find("array.jsonl:1: no string field"),
            std::string::npos);
  // A gzip file cut short: an error naming it, never a crash or silent truncation.
  std::string many;
  for (int i = 0; i < 20000; ++i) many += "{\"text\": \"document number " + std::to_string(i * 7919) + "\"}\n";
  write_gz(d / "cut.json.gz", many);
  const std::string gz = read_file(d / "cut.json.gz");
  write_file(d / "cut.json.gz", gz.substr(0, gz.size() / 2));
  const std::string cut = error_of([&] { all_docs({(d / "cut.json.gz").string()}); });
  EXPECT_NE(cut.find("cut.json.gz: cannot read"), std::string::npos) << cut;
}

TEST(TextSource, SkipBadCountsEachCase) {
  const fs::path d = fresh_dir("skip");
  write_file(d / "empty.jsonl", "");
  write_file(d / "mixed.jsonl", "{\"text\": \"one\"}\nnot json\n{\"x\": 1}\n{\"text\": \"two\"}\n{\"text\": [1]}\n");
  SourceOptions o;
  o.skip_bad = true;
  SourceStats s;
  const auto docs = all_docs({(d / "missing.jsonl").string(), (d / "*.none").string(), (d / "empty.jsonl").string(),
                              (d / "mixed.jsonl").string()},
                             o, &s);
  EXPECT_EQ(docs, (std::vector<std::string>{"one", "two"}));
  EXPECT_EQ(s.missing_files, 2);
  EXPECT_EQ(s.empty_files, 1);
  EXPECT_EQ(s.invalid_json_lines, 1);
  EXPECT_EQ(s.missing_field_lines, 2);
  EXPECT_EQ(s.documents, 2);
  EXPECT_EQ(s.skipped(), 6);
}

TEST(Shard, Fnv1aKnownAnswers) {
  EXPECT_EQ(fnv1a64("", 0), 0xcbf29ce484222325ull);
  EXPECT_EQ(fnv1a64("a", 1), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(fnv1a64("foobar", 6), 0x85944171f73967e8ull);
  const fs::path d = fresh_dir("hash");
  write_file(d / "tok.json", "foobar");
  EXPECT_EQ(tokenizer_file_hash((d / "tok.json").string()), 0x85944171f73967e8ull);
  EXPECT_NE(error_of([&] { tokenizer_file_hash((d / "none.json").string()); }).find("none.json"), std::string::npos);
}

TEST(Shard, RoundTripsUint16AndUint32) {
  const fs::path d = fresh_dir("roundtrip");
  std::vector<int32_t> small{0, 1, 255, 256, 257, 65535};
  write_shard((d / "u16.shard").string(), small, 42, 65536);
  EXPECT_EQ(fs::file_size(d / "u16.shard"), 32u + 2 * small.size());
  EXPECT_EQ(read_shard((d / "u16.shard").string(), 42, 65536), small);

  std::vector<int32_t> big{0, 65535, 65536, 128255, 7};
  write_shard((d / "u32.shard").string(), big, 7, 128256);
  EXPECT_EQ(fs::file_size(d / "u32.shard"), 32u + 4 * big.size());
  ShardReader r((d / "u32.shard").string(), 7, 128256);
  EXPECT_EQ(r.header().token_bytes, 4u);
  EXPECT_EQ(r.count(), 5);
  std::vector<int32_t> part;
  r.read(3, 10, part);  // clipped at the end
  r.read(1, 1, part);   // and read out of order
  EXPECT_EQ(part, (std::vector<int32_t>{128255, 7, 65535}));

  write_shard((d / "empty.shard").string(), {}, 1, 258);
  EXPECT_TRUE(read_shard((d / "empty.shard").string(), 1, 258).empty());
  EXPECT_EQ(shard_token_bytes(65536), 2u);
  EXPECT_EQ(shard_token_bytes(65537), 4u);
}

TEST(Shard, BadHeadersAreRefusedWithTheFileAndSizes) {
  const fs::path d = fresh_dir("badshard");
  const std::vector<int32_t> ids{1, 2, 3, 4, 5, 6, 7, 8};
  const std::string good = (d / "good.shard").string();
  write_shard(good, ids, 99, 1000);
  const std::string bytes = read_file(good);
  auto variant = [&](const std::string& name, std::string b) {
    write_file(d / name, b);
    return error_of([&] { read_shard((d / name).string(), 99, 1000); });
  };
  std::string b = bytes;
  b[0] = 'X';
  EXPECT_NE(variant("magic.shard", b).find("magic.shard: not an Anvil shard"), std::string::npos);
  b = bytes;
  b[8] = 2;
  EXPECT_NE(variant("version.shard", b).find("shard format version 2"), std::string::npos);
  b = bytes;
  b[12] = 3;
  EXPECT_NE(variant("dtype.shard", b).find("token width 3"), std::string::npos);
  const std::string hash = error_of([&] { read_shard(good, 98, 1000); });
  EXPECT_NE(hash.find("good.shard: tokenized with another tokenizer"), std::string::npos) << hash;
  const std::string trunc = variant("trunc.shard", bytes.substr(0, bytes.size() - 3));
  EXPECT_NE(trunc.find("trunc.shard: 45 bytes, but the header's 8 tokens of 2 bytes need 48 (truncated)"),
            std::string::npos)
      << trunc;
  EXPECT_NE(variant("tiny.shard", bytes.substr(0, 10)).find("tiny.shard: 10 bytes, shorter than the 32-byte"),
            std::string::npos);
  EXPECT_NE(variant("long.shard", bytes + "x").find("(trailing bytes)"), std::string::npos);
  b = bytes;
  b[24] = static_cast<char>(0xff);  // a count far beyond the file
  EXPECT_NE(variant("count.shard", b).find("count.shard:"), std::string::npos);
}

TEST(Shard, OutOfVocabularyIdNamesTheOffset) {
  const fs::path d = fresh_dir("oov");
  write_shard((d / "oov.shard").string(), {1, 2, 3, 4, 5, 700, 6}, 5, 1000);
  EXPECT_EQ(read_shard((d / "oov.shard").string(), 5, 701).size(), 7u);
  const std::string e = error_of([&] { read_shard((d / "oov.shard").string(), 5, 700); });
  EXPECT_NE(e.find("oov.shard: token 5 (byte offset 42) has id 700, outside the model's vocabulary of 700"),
            std::string::npos)
      << e;
}

TEST(Shard, TheTemporaryFileIsNeverReadableAsAShard) {
  const fs::path d = fresh_dir("tmp");
  const std::string path = (d / "s.shard").string();
  {
    ShardWriter w(path, 3, 258);
    w.append({1, 2, 3});
    EXPECT_TRUE(fs::exists(path + ".tmp"));
    EXPECT_FALSE(fs::exists(path));
    const std::string e = error_of([&] { read_shard(path + ".tmp", 3, 258); });
    EXPECT_NE(e.find("unfinished shard is never read"), std::string::npos) << e;
    // Even if it is renamed by hand, it is not a shard until finished.
    fs::copy_file(path + ".tmp", d / "copied.shard");
    EXPECT_NE(error_of([&] { read_shard((d / "copied.shard").string(), 3, 258); }).find("unfinished"),
              std::string::npos);
  }  // destroyed unfinished: the temporary file goes
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  EXPECT_FALSE(fs::exists(path));
  ShardWriter w(path, 3, 258);
  w.append({4, 5});
  w.finish();
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  EXPECT_EQ(read_shard(path, 3, 258), (std::vector<int32_t>{4, 5}));
  // A directory without a manifest is an unfinished tokenize run.
  EXPECT_NE(error_of([&] { list_shards(d.string()); }).find("manifest.json is missing"), std::string::npos);
}

namespace {
std::vector<int32_t> expected_stream(const std::vector<std::string>& docs) {
  std::vector<int32_t> out;
  for (const auto& t : docs) {
    out.push_back(256);
    for (unsigned char c : t) out.push_back(c);
    out.push_back(257);
  }
  return out;
}
std::vector<int32_t> read_all(const std::vector<std::string>& shards) {
  std::vector<int32_t> out;
  for (const auto& s : shards) {
    const auto ids = read_shard(s, byte_tokenizer_hash(), 258);
    out.insert(out.end(), ids.begin(), ids.end());
  }
  return out;
}
}  // namespace

TEST(Tokenize, ParsesArguments) {
  const TokenizeOptions o = parse_tokenize_args(
      {"--input", "a.jsonl", "dir/*.gz", "--output-dir", "out", "--text-field", "body", "--shard-tokens", "1000",
       "--skip-bad"});
  EXPECT_EQ(o.inputs, (std::vector<std::string>{"a.jsonl", "dir/*.gz"}));
  EXPECT_EQ(o.output_dir, "out");
  EXPECT_EQ(o.source.text_field, "body");
  EXPECT_EQ(o.shard_tokens, 1000);
  EXPECT_TRUE(o.source.skip_bad);
  EXPECT_NE(error_of([] { parse_tokenize_args({"--input", "a", "--output-dir", "o", "--shard-tokens", "0"}); })
                .find("--shard-tokens 0 is not a positive"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_tokenize_args({"--output-dir", "o"}); }).find("--input is required"),
            std::string::npos);
  EXPECT_NE(error_of([] { parse_tokenize_args({"--input", "a", "--output-dir", "o", "--frob"}); })
                .find("unknown option '--frob'"),
            std::string::npos);
}

TEST(Tokenize, WritesShardsAndRerunsSafely) {
  const fs::path d = fresh_dir("tokenize");
  write_file(d / "in" / "a.jsonl", kJsonl);
  write_gz(d / "in" / "b.json.gz", "{\"text\": \"gzipped one\"}\n{\"text\": \"gzipped two\"}\n");
  write_file(d / "in" / "c.txt", "a plain text document");
  TokenizeOptions o;
  o.inputs = {(d / "in").string()};
  o.output_dir = (d / "out").string();
  o.shard_tokens = 20;
  o.progress = true;  // off a terminal: one final line on stderr
  ByteTokenizer tok;
  const TokenizeResult r = tokenize_to_shards(o, tok, byte_tokenizer_hash());
  std::vector<std::string> docs = kJsonlDocs;
  docs.insert(docs.end(), {"gzipped one", "gzipped two", "a plain text document"});
  const std::vector<int32_t> want = expected_stream(docs);
  EXPECT_FALSE(r.up_to_date);
  EXPECT_EQ(r.documents, 7);
  EXPECT_EQ(r.tokens, static_cast<int64_t>(want.size()));
  EXPECT_GT(r.shards.size(), 2u);
  EXPECT_EQ(list_shards(o.output_dir), r.shards);
  EXPECT_EQ(read_all(r.shards), want);
  std::vector<std::string> before;
  for (const auto& s : r.shards) before.push_back(read_file(s));

  // Unchanged inputs: nothing to do.
  EXPECT_TRUE(tokenize_to_shards(o, tok, byte_tokenizer_hash()).up_to_date);

  // An interrupted run: no manifest, a stale temporary file, a stale extra shard.
  fs::remove(d / "out" / "manifest.json");
  write_file(d / "out" / "shard_000001.shard.tmp", "half");
  write_file(d / "out" / "shard_000099.shard", "stale");
  EXPECT_NE(error_of([&] { list_shards(o.output_dir); }).find("did not finish"), std::string::npos);
  const TokenizeResult again = tokenize_to_shards(o, tok, byte_tokenizer_hash());
  EXPECT_FALSE(again.up_to_date);
  ASSERT_EQ(again.shards, r.shards);
  for (size_t i = 0; i < before.size(); ++i) EXPECT_EQ(read_file(again.shards[i]), before[i]) << i;
  EXPECT_FALSE(fs::exists(d / "out" / "shard_000001.shard.tmp"));
  EXPECT_FALSE(fs::exists(d / "out" / "shard_000099.shard"));

  // A changed input is noticed.
  write_file(d / "in" / "c.txt", "changed");
  const TokenizeResult changed = tokenize_to_shards(o, tok, byte_tokenizer_hash());
  EXPECT_FALSE(changed.up_to_date);
  EXPECT_EQ(changed.documents, 7);

  // Bad input stops the run before a manifest exists, or is skipped and counted.
  write_file(d / "in" / "z.jsonl", "{\"text\": \"fine\"}\n{oops\n");
  const std::string e = error_of([&] { tokenize_to_shards(o, tok, byte_tokenizer_hash()); });
  EXPECT_NE(e.find("z.jsonl:2: invalid JSON"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(d / "out" / "manifest.json"));
  EXPECT_TRUE(fs::directory_iterator(d / "out") != fs::directory_iterator());
  for (const auto& f : fs::directory_iterator(d / "out")) EXPECT_NE(f.path().extension(), ".tmp") << f.path();
  o.source.skip_bad = true;
  const TokenizeResult skipped = tokenize_to_shards(o, tok, byte_tokenizer_hash());
  EXPECT_EQ(skipped.documents, 8);
  EXPECT_EQ(skipped.stats.invalid_json_lines, 1);
}
