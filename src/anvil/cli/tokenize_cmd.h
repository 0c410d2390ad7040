// `anvil tokenize`: text files -> token shards (see data/shard.h), each document as
// BOS, its ids, EOS. Safe to interrupt and rerun: each shard is written to a
// temporary file and renamed when complete, and the manifest that makes the directory
// usable is written last. A rerun over unchanged inputs finds the manifest and stops;
// otherwise it rewrites every shard (tokenizing is deterministic, so finished shards
// come out byte for byte the same) and removes shards the new run no longer makes.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "anvil/data/text_source.h"
#include "anvil/data/tokenizer.h"

namespace anvil {

struct TokenizeOptions {
  std::vector<std::string> inputs;  // files, directories, glob patterns
  std::string output_dir;
  SourceOptions source;                // text field, skip-bad
  int64_t shard_tokens = 100'000'000;  // a shard closes at the first document end past this
  bool progress = true;                // progress bar on stderr
  std::string tokenizer;               // tokenizer.json or tiktoken file; empty: byte-level
};

struct TokenizeResult {
  bool up_to_date = false;  // the manifest matched: nothing was done
  int64_t documents = 0;
  int64_t tokens = 0;
  std::vector<std::string> shards;  // paths, in order
  SourceStats stats;
  double seconds = 0;
};

// Parses the words after `anvil tokenize`; throws anvil::Error on bad usage.
TokenizeOptions parse_tokenize_args(const std::vector<std::string>& args);

// Tokenizes with any tokenizer; tokenizer_hash goes into every shard header
// (tokenizer_file_hash(path) for a file, byte_tokenizer_hash() for bytes).
TokenizeResult tokenize_to_shards(const TokenizeOptions& opts, const Tokenizer& tokenizer, uint64_t tokenizer_hash);

// The CLI entry: returns the exit code; bad usage and bad input throw anvil::Error.
int tokenize_command(const std::vector<std::string>& args);

}  // namespace anvil
