// Token shards: pre-tokenized text on disk, so training never waits for a tokenizer.
//
// Layout (little-endian), 32 bytes of header then the tokens:
//   0  char[8]  magic "ANVLSHRD"
//   8  u32      version (1)
//  12  u32      bytes per token: 2 (uint16, vocabularies up to 65,536) or 4 (uint32)
//  16  u64      hash of the tokenizer the ids belong to (FNV-1a 64 over its file)
//  24  u64      token count
//  32  count × (u16 | u32) token ids
//
// A shard is written to "<path>.tmp" under a different magic ("ANVLPART") and only
// renamed to its name once complete, so an interrupted write never leaves a file
// that reads as a shard.
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace anvil {

inline constexpr char kShardMagic[8] = {'A', 'N', 'V', 'L', 'S', 'H', 'R', 'D'};
inline constexpr uint32_t kShardVersion = 1;
inline constexpr int64_t kShardHeaderBytes = 32;
inline constexpr const char* kShardExtension = ".shard";

// FNV-1a, 64 bits: a stable fingerprint of bytes (not a cryptographic hash).
inline constexpr uint64_t kFnv1aOffset = 0xcbf29ce484222325ull;
uint64_t fnv1a64(const void* data, size_t n, uint64_t hash = kFnv1aOffset);
// FNV-1a 64 over a tokenizer file's bytes; throws naming the file when unreadable.
uint64_t tokenizer_file_hash(const std::string& path);
// The byte tokenizer has no file: its hash is that of its name.
uint64_t byte_tokenizer_hash();

// 2 (uint16) when every id fits, else 4 (uint32).
uint32_t shard_token_bytes(int64_t vocab_size);

struct ShardHeader {
  uint32_t version = kShardVersion;
  uint32_t token_bytes = 2;
  uint64_t tokenizer_hash = 0;
  uint64_t count = 0;
};

// Writes one shard incrementally to "<path>.tmp"; finish() renames it into place.
// Destroyed unfinished (an error mid-way), it removes the temporary file.
class ShardWriter {
 public:
  ShardWriter(std::string path, uint64_t tokenizer_hash, int64_t vocab_size);
  ~ShardWriter();
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;

  void append(const int32_t* ids, size_t n);
  void append(const std::vector<int32_t>& ids) { append(ids.data(), ids.size()); }
  void finish();
  uint64_t count() const { return header_.count; }
  std::string tmp_path() const { return path_ + ".tmp"; }

 private:
  std::string path_;
  int64_t vocab_size_;
  ShardHeader header_;
  std::FILE* f_ = nullptr;
  std::vector<uint8_t> buf_;
};

// Writes a whole shard at once (through ShardWriter).
void write_shard(const std::string& path, const std::vector<int32_t>& ids, uint64_t tokenizer_hash,
                 int64_t vocab_size);

// Reads a shard's tokens, checking the header against what the caller expects:
// magic, version, the tokenizer hash, the token width, that the file size matches
// the count, and every id below vocab_size. Each failure names the file and what to do.
class ShardReader {
 public:
  ShardReader(std::string path, uint64_t expected_tokenizer_hash, int64_t vocab_size);
  ~ShardReader();
  ShardReader(const ShardReader&) = delete;
  ShardReader& operator=(const ShardReader&) = delete;

  const ShardHeader& header() const { return header_; }
  int64_t count() const { return static_cast<int64_t>(header_.count); }
  const std::string& path() const { return path_; }
  // Appends tokens [offset, offset + n) to out (n clipped to the end).
  void read(int64_t offset, int64_t n, std::vector<int32_t>& out);

 private:
  std::string path_;
  int64_t vocab_size_;
  ShardHeader header_;
  std::FILE* f_ = nullptr;
  int64_t file_pos_ = -1;  // token index the file position is at
  std::vector<uint8_t> buf_;
};

std::vector<int32_t> read_shard(const std::string& path, uint64_t expected_tokenizer_hash, int64_t vocab_size);

// anvil tokenize writes this last, listing the shards it made (a "shards" array of
// {"name", "tokens"}): a directory without it is unfinished.
inline constexpr const char* kShardManifest = "manifest.json";

// The shards of a directory made by anvil tokenize, in order, as its manifest lists
// them; throws when the manifest is missing (an interrupted run) or names a missing file.
std::vector<std::string> list_shards(const std::string& dir);

}  // namespace anvil
