#include "anvil/data/shard.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string_view>

#include "anvil/core/error.h"

namespace fs = std::filesystem;

namespace anvil {

namespace {

constexpr char kPartMagic[8] = {'A', 'N', 'V', 'L', 'P', 'A', 'R', 'T'};

void put_u32(uint8_t* p, uint32_t v) {
  for (int i = 0; i < 4; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
void put_u64(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}
uint32_t get_u32(const uint8_t* p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
uint64_t get_u64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

void encode_header(const char (&magic)[8], const ShardHeader& h, uint8_t* out) {
  std::memcpy(out, magic, 8);
  put_u32(out + 8, h.version);
  put_u32(out + 12, h.token_bytes);
  put_u64(out + 16, h.tokenizer_hash);
  put_u64(out + 24, h.count);
}

std::string hex(uint64_t v) {
  char s[24];
  std::snprintf(s, sizeof s, "%016llx", static_cast<unsigned long long>(v));
  return s;
}

}  // namespace

uint64_t fnv1a64(const void* data, size_t n, uint64_t hash) {
  const auto* p = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < n; ++i) {
    hash ^= p[i];
    hash *= 0x100000001b3ull;
  }
  return hash;
}

uint64_t tokenizer_file_hash(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  ANVIL_CHECK(f != nullptr, path, ": cannot open the tokenizer file (", std::strerror(errno), ")");
  uint64_t h = kFnv1aOffset;
  std::vector<char> buf(1 << 16);
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), f)) > 0) h = fnv1a64(buf.data(), n, h);
  const bool failed = std::ferror(f) != 0;
  std::fclose(f);
  ANVIL_CHECK(!failed, path, ": read error while hashing the tokenizer file");
  return h;
}

uint64_t byte_tokenizer_hash() {
  constexpr std::string_view name = "anvil byte tokenizer";
  return fnv1a64(name.data(), name.size());
}

uint32_t shard_token_bytes(int64_t vocab_size) { return vocab_size <= 65536 ? 2 : 4; }

// ---- writer ----

ShardWriter::ShardWriter(std::string path, uint64_t tokenizer_hash, int64_t vocab_size)
    : path_(std::move(path)), vocab_size_(vocab_size) {
  ANVIL_ASSERT(vocab_size > 0 && vocab_size <= (int64_t{1} << 32));
  header_.token_bytes = shard_token_bytes(vocab_size);
  header_.tokenizer_hash = tokenizer_hash;
  f_ = std::fopen(tmp_path().c_str(), "wb");
  ANVIL_CHECK(f_ != nullptr, tmp_path(), ": cannot create (", std::strerror(errno),
              "); check that the output directory exists and is writable");
  uint8_t h[kShardHeaderBytes];
  encode_header(kPartMagic, header_, h);  // not a shard until finish()
  // Flushed at once, so even a copy of an early temporary file reads as unfinished.
  ANVIL_CHECK(std::fwrite(h, 1, sizeof h, f_) == sizeof h && std::fflush(f_) == 0, tmp_path(), ": write failed (",
              std::strerror(errno), ")");
}

ShardWriter::~ShardWriter() {
  if (f_ != nullptr) {
    std::fclose(f_);
    std::remove(tmp_path().c_str());
  }
}

void ShardWriter::append(const int32_t* ids, size_t n) {
  ANVIL_ASSERT(f_ != nullptr, "append after finish");
  if (n == 0) return;  // an empty buffer's data() may be null, which fwrite must not get
  const uint32_t w = header_.token_bytes;
  buf_.resize(n * w);
  for (size_t i = 0; i < n; ++i) {
    ANVIL_ASSERT(ids[i] >= 0 && ids[i] < vocab_size_, "token id ", ids[i], " outside the vocabulary of ", vocab_size_);
    const auto v = static_cast<uint32_t>(ids[i]);
    if (w == 2) {
      buf_[2 * i] = static_cast<uint8_t>(v);
      buf_[2 * i + 1] = static_cast<uint8_t>(v >> 8);
    } else {
      put_u32(&buf_[4 * i], v);
    }
  }
  ANVIL_CHECK(std::fwrite(buf_.data(), 1, buf_.size(), f_) == buf_.size(), tmp_path(), ": write failed (",
              std::strerror(errno), "); is the disk full?");
  header_.count += n;
}

void ShardWriter::finish() {
  ANVIL_ASSERT(f_ != nullptr, "finish twice");
  uint8_t h[kShardHeaderBytes];
  encode_header(kShardMagic, header_, h);
  const bool ok = std::fflush(f_) == 0 && std::fseek(f_, 0, SEEK_SET) == 0 && std::fwrite(h, 1, sizeof h, f_) == sizeof h &&
                  std::fflush(f_) == 0;
  const bool closed = std::fclose(f_) == 0;
  f_ = nullptr;
  if (!ok || !closed) {
    std::remove(tmp_path().c_str());
    throw Error(tmp_path() + ": write failed (" + std::strerror(errno) + "); is the disk full?");
  }
  std::error_code ec;
  fs::rename(tmp_path(), path_, ec);
  ANVIL_CHECK(!ec, "cannot rename ", tmp_path(), " to ", path_, " (", ec.message(), ")");
}

void write_shard(const std::string& path, const std::vector<int32_t>& ids, uint64_t tokenizer_hash,
                 int64_t vocab_size) {
  ShardWriter w(path, tokenizer_hash, vocab_size);
  w.append(ids);
  w.finish();
}

// ---- reader ----

ShardReader::ShardReader(std::string path, uint64_t expected_tokenizer_hash, int64_t vocab_size)
    : path_(std::move(path)), vocab_size_(vocab_size) {
  ANVIL_CHECK(!(path_.size() > 4 && path_.compare(path_.size() - 4, 4, ".tmp") == 0), path_,
              ": the temporary file of an unfinished shard is never read; rerun anvil tokenize");
  f_ = std::fopen(path_.c_str(), "rb");
  ANVIL_CHECK(f_ != nullptr, path_, ": cannot open the shard (", std::strerror(errno), ")");
  std::error_code ec;
  const auto size = static_cast<int64_t>(fs::file_size(path_, ec));
  ANVIL_CHECK(!ec, path_, ": cannot read the size (", ec.message(), ")");
  uint8_t h[kShardHeaderBytes];
  ANVIL_CHECK(size >= kShardHeaderBytes && std::fread(h, 1, sizeof h, f_) == sizeof h, path_, ": ", size,
              " bytes, shorter than the ", kShardHeaderBytes, "-byte shard header; rerun anvil tokenize");
  ANVIL_CHECK(std::memcmp(h, kPartMagic, 8) != 0, path_,
              ": an unfinished shard left by an interrupted anvil tokenize; rerun it to rewrite the shards");
  ANVIL_CHECK(std::memcmp(h, kShardMagic, 8) == 0, path_, ": not an Anvil shard (the file does not start with \"",
              std::string_view(kShardMagic, 8), "\")");
  header_.version = get_u32(h + 8);
  header_.token_bytes = get_u32(h + 12);
  header_.tokenizer_hash = get_u64(h + 16);
  header_.count = get_u64(h + 24);
  ANVIL_CHECK(header_.version == kShardVersion, path_, ": shard format version ", header_.version,
              ", this Anvil reads version ", kShardVersion, "; rerun anvil tokenize");
  ANVIL_CHECK(header_.token_bytes == 2 || header_.token_bytes == 4, path_, ": token width ", header_.token_bytes,
              " bytes in the header, expected 2 (uint16) or 4 (uint32); the header is corrupt");
  ANVIL_CHECK(header_.tokenizer_hash == expected_tokenizer_hash, path_, ": tokenized with another tokenizer (hash ",
              hex(header_.tokenizer_hash), ", this run's tokenizer has ", hex(expected_tokenizer_hash),
              "); rerun anvil tokenize with this tokenizer or use the tokenizer the shards were made with");
  ANVIL_CHECK(header_.count <= static_cast<uint64_t>(size), path_, ": the header's token count ", header_.count,
              " cannot fit in a file of ", size, " bytes; the header is corrupt");
  const int64_t expected = kShardHeaderBytes + static_cast<int64_t>(header_.count) * header_.token_bytes;
  ANVIL_CHECK(size == expected, path_, ": ", size, " bytes, but the header's ", header_.count, " tokens of ",
              header_.token_bytes, " bytes need ", expected, size < expected ? " (truncated)" : " (trailing bytes)",
              "; rerun anvil tokenize");
  file_pos_ = 0;
}

ShardReader::~ShardReader() {
  if (f_ != nullptr) std::fclose(f_);
}

void ShardReader::read(int64_t offset, int64_t n, std::vector<int32_t>& out) {
  ANVIL_ASSERT(offset >= 0 && n >= 0);
  n = std::min(n, count() - offset);
  if (n <= 0) return;
  const uint32_t w = header_.token_bytes;
  if (file_pos_ != offset) {
    ANVIL_CHECK(std::fseek(f_, static_cast<long>(kShardHeaderBytes + offset * w), SEEK_SET) == 0, path_,
                ": seek failed (", std::strerror(errno), ")");
    file_pos_ = offset;
  }
  buf_.resize(static_cast<size_t>(n) * w);
  ANVIL_CHECK(std::fread(buf_.data(), 1, buf_.size(), f_) == buf_.size(), path_, ": read failed at token ", offset,
              " (the file changed while reading?)");
  file_pos_ += n;
  const size_t base = out.size();
  out.resize(base + static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* p = &buf_[static_cast<size_t>(i) * w];
    const uint32_t v = w == 2 ? static_cast<uint32_t>(p[0] | (p[1] << 8)) : get_u32(p);
    if (static_cast<int64_t>(v) >= vocab_size_) {
      out.resize(base);
      throw Error(path_ + ": token " + std::to_string(offset + i) + " (byte offset " +
                  std::to_string(kShardHeaderBytes + (offset + i) * w) + ") has id " + std::to_string(v) +
                  ", outside the model's vocabulary of " + std::to_string(vocab_size_) +
                  "; the shard was made for a larger vocabulary, or is corrupt");
    }
    out[base + static_cast<size_t>(i)] = static_cast<int32_t>(v);
  }
}

std::vector<int32_t> read_shard(const std::string& path, uint64_t expected_tokenizer_hash, int64_t vocab_size) {
  ShardReader r(path, expected_tokenizer_hash, vocab_size);
  std::vector<int32_t> out;
  out.reserve(static_cast<size_t>(r.count()));
  r.read(0, r.count(), out);
  return out;
}

std::vector<std::string> list_shards(const std::string& dir) {
  std::error_code ec;
  ANVIL_CHECK(fs::is_directory(dir, ec), dir, ": no such directory of shards; create it with anvil tokenize");
  const fs::path manifest = fs::path(dir) / kShardManifest;
  std::ifstream in(manifest);
  ANVIL_CHECK(in.good(), manifest.string(), " is missing: anvil tokenize did not finish writing ", dir,
              "; rerun it (it rewrites the shards consistently)");
  std::vector<std::string> out;
  try {
    const nlohmann::json j = nlohmann::json::parse(in);
    for (const auto& s : j.at("shards")) {
      const fs::path p = fs::path(dir) / s.at("name").get<std::string>();
      ANVIL_CHECK(fs::is_regular_file(p, ec), manifest.string(), " lists ", p.string(),
                  ", which is missing; rerun anvil tokenize");
      out.push_back(p.string());
    }
  } catch (const nlohmann::json::exception& e) {
    throw Error(manifest.string() + ": malformed (" + e.what() + "); rerun anvil tokenize");
  }
  return out;
}

}  // namespace anvil
