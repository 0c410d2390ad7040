#include "anvil/cli/tokenize_cmd.h"

#include "anvil/data/bpe_tokenizer.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>

#include "anvil/core/error.h"
#include "anvil/data/shard.h"

namespace fs = std::filesystem;

namespace anvil {

namespace {

constexpr const char* kUsage =
    "usage: anvil tokenize --input PATH|DIR|GLOB... --output-dir DIR [--tokenizer PATH] [--text-field text] "
    "[--shard-tokens N] [--skip-bad]\n"
    "  --tokenizer     tokenizer.json (byte-level BPE) or tiktoken file (default: byte-level)\n"
    "  --input         JSON Lines (.json/.jsonl, optionally .gz) or text files (one document each), directories, "
    "globs\n"
    "  --output-dir    where shard_NNNNNN.shard files and manifest.json go\n"
    "  --text-field    the JSON field holding a document's text (default: text)\n"
    "  --shard-tokens  a shard ends at the first document end past this many tokens (default: 100000000)\n"
    "  --skip-bad      skip and count bad input (missing or empty files, bad lines) instead of stopping\n\n"
    "examples:\n"
    "  anvil tokenize --input data/text/ --output-dir data/shards\n"
    "  anvil tokenize --input 'data/web/*.jsonl.gz' --tokenizer tokenizer.json --output-dir data/web --skip-bad\n";

std::string shard_name(size_t index) {
  char s[32];
  std::snprintf(s, sizeof s, "shard_%06zu%s", index, kShardExtension);
  return s;
}

std::string hex(uint64_t v) {
  char s[24];
  std::snprintf(s, sizeof s, "%016llx", static_cast<unsigned long long>(v));
  return s;
}

// What the output depends on: the tokenizer, the options and every input file's
// size and modification time. A manifest with the same fingerprint means done.
nlohmann::json fingerprint(const TokenizeOptions& opts, const std::vector<std::string>& files,
                           const Tokenizer& tokenizer, uint64_t tokenizer_hash) {
  nlohmann::json inputs = nlohmann::json::array();
  for (const auto& f : files) {
    std::error_code ec;
    const auto size = fs::file_size(f, ec);
    const auto mtime = fs::last_write_time(f, ec).time_since_epoch().count();
    inputs.push_back({{"path", fs::absolute(f).string()},
                      {"size", ec ? -1 : static_cast<int64_t>(size)},
                      {"mtime", static_cast<int64_t>(mtime)}});
  }
  return {{"tokenizer", tokenizer.name()},       {"tokenizer_hash", hex(tokenizer_hash)},
          {"vocab_size", tokenizer.vocab_size()}, {"text_field", opts.source.text_field},
          {"skip_bad", opts.source.skip_bad},     {"shard_tokens", opts.shard_tokens},
          {"inputs", inputs}};
}

bool manifest_matches(const fs::path& dir, const nlohmann::json& fp) {
  std::ifstream in(dir / kShardManifest);
  if (!in) return false;
  const nlohmann::json m = nlohmann::json::parse(in, nullptr, false);
  if (m.is_discarded() || !m.contains("fingerprint") || m["fingerprint"] != fp || !m.contains("shards")) return false;
  for (const auto& s : m["shards"]) {
    std::error_code ec;
    const auto size = fs::file_size(dir / s.value("name", std::string()), ec);
    if (ec || static_cast<int64_t>(size) != s.value("bytes", int64_t{-1})) return false;
  }
  return true;
}

std::string clock_str(double seconds) {
  const auto s = static_cast<long long>(seconds + 0.5);
  char out[32];
  if (s >= 3600)
    std::snprintf(out, sizeof out, "%lld:%02lld:%02lld", s / 3600, s / 60 % 60, s % 60);
  else
    std::snprintf(out, sizeof out, "%lld:%02lld", s / 60, s % 60);
  return out;
}

// A one-line bar redrawn in place on a terminal; elsewhere a line every 10 seconds.
class ProgressBar {
 public:
  ProgressBar(bool enabled, int64_t total_bytes)
      : enabled_(enabled), tty_(isatty(STDERR_FILENO) != 0), total_(total_bytes), start_(now()) {}

  void update(int64_t done_bytes, int64_t docs, int64_t shards, bool final = false) {
    if (!enabled_) return;
    const double t = now() - start_;
    if (!final && t - last_ < (tty_ ? 0.2 : 10.0)) return;
    last_ = t;
    const double frac = total_ > 0 ? std::min(1.0, static_cast<double>(done_bytes) / static_cast<double>(total_)) : 1.0;
    const double mbps = t > 0 ? static_cast<double>(done_bytes) / 1e6 / t : 0.0;
    const double eta = frac > 0 && !final ? t * (1 - frac) / frac : 0.0;
    constexpr int kWidth = 30;
    std::string bar(kWidth, ' ');
    for (int i = 0; i < static_cast<int>(frac * kWidth); ++i) bar[static_cast<size_t>(i)] = '#';
    std::fprintf(stderr, "%s%5.1f%% [%s] %.1f/%.1f MB  %.2f MB/s  ETA %s  %lld docs  %lld shard(s)%s",
                 tty_ ? "\r" : "", 100 * frac, bar.c_str(), static_cast<double>(done_bytes) / 1e6,
                 static_cast<double>(total_) / 1e6, mbps, clock_str(eta).c_str(), static_cast<long long>(docs),
                 static_cast<long long>(shards), tty_ && !final ? "" : "\n");
    std::fflush(stderr);
  }

 private:
  static double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  bool enabled_, tty_;
  int64_t total_;
  double start_, last_ = -1e9;
};

}  // namespace

TokenizeOptions parse_tokenize_args(const std::vector<std::string>& args) {
  TokenizeOptions o;
  auto value = [&](size_t& i) -> const std::string& {
    ANVIL_CHECK(i + 1 < args.size(), "anvil tokenize: ", args[i], " needs a value\n", kUsage);
    return args[++i];
  };
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--input") {
      const size_t before = o.inputs.size();
      while (i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0) o.inputs.push_back(args[++i]);
      ANVIL_CHECK(o.inputs.size() > before, "anvil tokenize: --input needs at least one path or pattern\n", kUsage);
    } else if (a == "--output-dir") {
      o.output_dir = value(i);
    } else if (a == "--tokenizer") {
      o.tokenizer = value(i);
    } else if (a == "--text-field") {
      o.source.text_field = value(i);
    } else if (a == "--shard-tokens") {
      const std::string& v = value(i);
      char* end = nullptr;
      const long long n = std::strtoll(v.c_str(), &end, 10);
      ANVIL_CHECK(end != v.c_str() && *end == '\0' && n > 0, "anvil tokenize: --shard-tokens ", v,
                  " is not a positive whole number");
      o.shard_tokens = n;
    } else if (a == "--skip-bad") {
      o.source.skip_bad = true;
    } else if (a == "--no-progress") {
      o.progress = false;
    } else {
      throw Error("anvil tokenize: unknown option '" + a + "'\n" + kUsage);
    }
  }
  ANVIL_CHECK(!o.inputs.empty(), "anvil tokenize: --input is required\n", kUsage);
  ANVIL_CHECK(!o.output_dir.empty(), "anvil tokenize: --output-dir is required\n", kUsage);
  return o;
}

TokenizeResult tokenize_to_shards(const TokenizeOptions& opts, const Tokenizer& tokenizer, uint64_t tokenizer_hash) {
  const auto t0 = std::chrono::steady_clock::now();
  TokenizeResult r;
  DocumentSource docs(opts.inputs, opts.source);
  ANVIL_CHECK(!docs.files().empty(), "anvil tokenize: no input files (every input was missing and skipped)");
  const fs::path dir = opts.output_dir;
  std::error_code ec;
  fs::create_directories(dir, ec);
  ANVIL_CHECK(!ec, dir.string(), ": cannot create the output directory (", ec.message(), ")");

  const nlohmann::json fp = fingerprint(opts, docs.files(), tokenizer, tokenizer_hash);
  if (manifest_matches(dir, fp)) {
    r.up_to_date = true;
    r.shards = list_shards(dir.string());
    return r;
  }
  // From here the directory is unfinished until the new manifest lands. Temporary
  // files of an interrupted run are never read; clear them away.
  fs::remove(dir / kShardManifest, ec);
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file() && e.path().extension() == ".tmp") fs::remove(e.path(), ec);

  ProgressBar bar(opts.progress, docs.total_bytes());
  nlohmann::json shards = nlohmann::json::array();
  std::unique_ptr<ShardWriter> writer;
  auto close_shard = [&] {
    writer->finish();
    const std::string name = shard_name(r.shards.size());
    const int64_t tokens = static_cast<int64_t>(writer->count());
    shards.push_back({{"name", name},
                      {"tokens", tokens},
                      {"bytes", kShardHeaderBytes + tokens * shard_token_bytes(tokenizer.vocab_size())}});
    r.shards.push_back((dir / name).string());
    writer.reset();
  };
  std::string text;
  std::vector<int32_t> ids;
  while (docs.next(text)) {
    if (writer == nullptr)
      writer = std::make_unique<ShardWriter>((dir / shard_name(r.shards.size())).string(), tokenizer_hash,
                                             tokenizer.vocab_size());
    ids.clear();
    ids.push_back(tokenizer.bos_id());
    const std::vector<int32_t> body = tokenizer.encode(text);
    ids.insert(ids.end(), body.begin(), body.end());
    ids.push_back(tokenizer.eos_id());
    writer->append(ids);
    r.tokens += static_cast<int64_t>(ids.size());
    ++r.documents;
    if (static_cast<int64_t>(writer->count()) >= opts.shard_tokens) close_shard();
    bar.update(docs.bytes_done(), r.documents, static_cast<int64_t>(r.shards.size()));
  }
  if (writer != nullptr) close_shard();
  ANVIL_CHECK(r.documents > 0, "anvil tokenize: the inputs hold no documents (", docs.stats().skipped(),
              " bad input(s) skipped)");
  bar.update(docs.bytes_done(), r.documents, static_cast<int64_t>(r.shards.size()), true);

  // Shards an earlier run made beyond this run's count are stale.
  std::set<std::string> made;
  for (const auto& s : shards) made.insert(s["name"].get<std::string>());
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file() && e.path().extension() == kShardExtension && !made.count(e.path().filename().string()))
      fs::remove(e.path(), ec);

  r.stats = docs.stats();
  const SourceStats& st = r.stats;
  const nlohmann::json manifest = {
      {"version", 1},
      {"fingerprint", fp},
      {"documents", r.documents},
      {"tokens", r.tokens},
      {"skipped",
       {{"missing_files", st.missing_files},
        {"empty_files", st.empty_files},
        {"invalid_json_lines", st.invalid_json_lines},
        {"missing_field_lines", st.missing_field_lines},
        {"unreadable_files", st.unreadable_files}}},
      {"shards", shards}};
  const fs::path tmp = dir / (std::string(kShardManifest) + ".tmp");
  {
    std::ofstream out(tmp);
    out << manifest.dump(2) << "\n";
    ANVIL_CHECK(out.good(), tmp.string(), ": write failed; is the disk full?");
  }
  fs::rename(tmp, dir / kShardManifest, ec);
  ANVIL_CHECK(!ec, "cannot rename ", tmp.string(), " (", ec.message(), ")");
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

int tokenize_command(const std::vector<std::string>& args) {
  for (const auto& a : args)
    if (a == "--help" || a == "-h") {
      std::printf("%s", kUsage);
      return 0;
    }
  const TokenizeOptions opts = parse_tokenize_args(args);
  const std::unique_ptr<Tokenizer> tokenizer = load_tokenizer(opts.tokenizer.empty() ? "bytes" : opts.tokenizer);
  const uint64_t hash = opts.tokenizer.empty() ? byte_tokenizer_hash() : tokenizer_file_hash(opts.tokenizer);
  const TokenizeResult r = tokenize_to_shards(opts, *tokenizer, hash);
  if (r.up_to_date) {
    std::printf("anvil tokenize: %s is up to date (%zu shard(s)); nothing to do\n", opts.output_dir.c_str(),
                r.shards.size());
    return 0;
  }
  std::printf("anvil tokenize: %lld documents, %lld tokens in %zu shard(s) in %s (%.2fs)\n",
              static_cast<long long>(r.documents), static_cast<long long>(r.tokens), r.shards.size(),
              opts.output_dir.c_str(), r.seconds);
  const SourceStats& s = r.stats;
  if (s.skipped() > 0)
    std::printf("anvil tokenize: skipped %lld missing file(s), %lld empty file(s), %lld invalid JSON line(s), "
                "%lld line(s) without \"%s\", %lld unreadable file(s)\n",
                static_cast<long long>(s.missing_files), static_cast<long long>(s.empty_files),
                static_cast<long long>(s.invalid_json_lines), static_cast<long long>(s.missing_field_lines),
                opts.source.text_field.c_str(), static_cast<long long>(s.unreadable_files));
  return 0;
}

}  // namespace anvil
