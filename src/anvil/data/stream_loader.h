// The streaming packing loader: documents (BOS … EOS each) joined into one token
// stream that runs on through epochs, cut into windows of seq_len + 1 tokens.
// Window g is stream tokens [g·seq_len, g·seq_len + seq_len + 1): consecutive windows
// share one token, so the last target of one is the first input of the next and no
// token goes unused. Inputs are a window's first seq_len tokens, targets its last.
//
// Rank slicing: with `world` data-parallel ranks, rank r takes windows r, r + world,
// r + 2·world, …; its batch k holds its windows k·B … k·B + B − 1. The union of every
// rank's batch k is then exactly the single-process batch k for the global batch
// world·B, so any parallel layout sees the same data (and the same loss).
//
// The state (epoch, unit and cursor within it, the carried-over tokens and the next
// window) is small and exact: saved as JSON and restored, the stream continues at the
// token where it stopped. A prefetch thread prepares the next batch while the caller
// computes; wait_seconds() says how long the caller waited for data anyway.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "anvil/core/tensor.h"
#include "anvil/data/text_source.h"
#include "anvil/data/tokenizer.h"

namespace anvil {

class ShardReader;

// A dataset as an ordered list of units (shard files, or text files) that yield tokens.
class TokenSource {
 public:
  virtual ~TokenSource() = default;
  virtual size_t num_units() const = 0;
  virtual std::string unit_name(size_t unit) const = 0;
  // The unit's token count when known without reading it (shards; the cursor is then
  // a token index), else -1 (text; the cursor counts documents).
  virtual int64_t unit_tokens(size_t unit) = 0;
  // Appends tokens of `unit` from cursor `offset`: at most max_tokens for shards, one
  // whole document for text. Returns the cursor after them, or -1 at the unit's end.
  virtual int64_t read(size_t unit, int64_t offset, int64_t max_tokens, std::vector<int32_t>& out) = 0;
};

// Pre-tokenized shards: every header is checked up front (tokenizer hash, size), every
// id as it is read.
class ShardSource final : public TokenSource {
 public:
  ShardSource(std::vector<std::string> paths, uint64_t tokenizer_hash, int64_t vocab_size);
  ~ShardSource() override;
  size_t num_units() const override { return paths_.size(); }
  std::string unit_name(size_t unit) const override { return paths_[unit]; }
  int64_t unit_tokens(size_t unit) override { return counts_[unit]; }
  int64_t read(size_t unit, int64_t offset, int64_t max_tokens, std::vector<int32_t>& out) override;
  int64_t total_tokens() const;

 private:
  std::vector<std::string> paths_;
  std::vector<int64_t> counts_;
  uint64_t tokenizer_hash_;
  int64_t vocab_size_;
  std::unique_ptr<ShardReader> open_;
  size_t open_unit_ = 0;
};

// Text files (JSON Lines, gzip, plain text) tokenized as they are read. The tokenizer
// must outlive the source.
class DocumentTokenSource final : public TokenSource {
 public:
  DocumentTokenSource(const std::vector<std::string>& inputs, SourceOptions opts, const Tokenizer& tokenizer);
  size_t num_units() const override { return files_.size(); }
  std::string unit_name(size_t unit) const override { return files_[unit]; }
  int64_t unit_tokens(size_t) override { return -1; }
  int64_t read(size_t unit, int64_t offset, int64_t max_tokens, std::vector<int32_t>& out) override;
  // Counts of what was read and skipped (a file reopened to resume counts again).
  const SourceStats& stats() const { return stats_; }

 private:
  SourceOptions opts_;
  SourceStats stats_;
  const Tokenizer& tokenizer_;
  std::vector<std::string> files_;
  std::unique_ptr<FileDocuments> open_;
  size_t open_unit_ = 0;
  int64_t open_docs_ = 0;  // documents read from open_
  std::string text_;
};

// An in-memory token stream (a small corpus tokenized up front, e.g. the Brown
// corpus after its tags are stripped) as a single unit.
class TokenVectorSource final : public TokenSource {
 public:
  TokenVectorSource(std::string name, std::vector<int32_t> tokens)
      : name_(std::move(name)), tokens_(std::move(tokens)) {}
  size_t num_units() const override { return 1; }
  std::string unit_name(size_t) const override { return name_; }
  int64_t unit_tokens(size_t) override { return static_cast<int64_t>(tokens_.size()); }
  int64_t read(size_t unit, int64_t offset, int64_t max_tokens, std::vector<int32_t>& out) override;

 private:
  std::string name_;
  std::vector<int32_t> tokens_;
};

struct StreamLoaderOptions {
  int64_t seq_len = 0;
  int64_t batch_size = 0;  // windows per batch on this rank
  int rank = 0;
  int world = 1;
  uint64_t seed = 0;
  bool shuffle = false;    // a new unit order every epoch, from (seed, epoch)
  int64_t max_epochs = 0;  // 0: no limit; else next_batch returns false when they are used up
  bool prefetch = true;
  std::string what = "the training data";  // how a warning names this stream
};

// Where the stream stands for one rank.
struct StreamState {
  int64_t epoch = 0;        // the pass over the dataset being read
  int64_t unit = 0;         // index into this epoch's unit order
  int64_t offset = 0;       // cursor within that unit (see TokenSource)
  int64_t stream_pos = 0;   // stream index of carry[0] (the stream runs on through epochs)
  int64_t epoch_start = 0;  // stream index where this epoch began
  std::vector<int32_t> carry;  // tokens read but still needed
  int64_t next_window = 0;     // global index of this rank's next window
  bool operator==(const StreamState&) const = default;
};

class StreamLoader {
 public:
  StreamLoader(std::unique_ptr<TokenSource> source, StreamLoaderOptions opts);
  ~StreamLoader();
  StreamLoader(const StreamLoader&) = delete;
  StreamLoader& operator=(const StreamLoader&) = delete;

  // The next batch, row-major (batch_size, seq_len); false when max_epochs is used up.
  bool next(std::vector<int32_t>& inputs, std::vector<int32_t>& targets);
  // The same into i32 tensors of shape (batch_size, seq_len).
  bool next_batch(Tensor& tokens, Tensor& targets);

  // The state after the last batch returned (not the prefetched one).
  const StreamState& state() const { return state_; }
  // The state with the options it depends on and the current unit's name, for checkpoints.
  nlohmann::json state_json() const;
  // Continues from a saved state; throws naming the mismatch when the dataset or the
  // options differ from the run that saved it. A state saved by data-parallel rank 0
  // (what checkpoints hold) also loads on any rank of another data-parallel size,
  // which then continues the same global stream.
  void load_state_json(const nlohmann::json& j);
  void set_state(const StreamState& s);

  // Seconds the caller spent waiting inside next(), and batches returned.
  double wait_seconds() const { return wait_seconds_; }
  int64_t batches() const { return batches_; }
  const StreamLoaderOptions& options() const { return opts_; }

 private:
  struct Batch {
    std::vector<int32_t> inputs, targets;
    StreamState after;
  };
  bool produce(StreamState& s, Batch& b);                // fills one batch from s
  bool ensure(StreamState& s, int64_t begin, int64_t end);  // carry covers [begin, end)
  static void drop_before(StreamState& s, int64_t pos);
  const std::vector<size_t>& order(int64_t epoch);
  void start_prefetch();
  void stop_prefetch();
  void prefetch_loop(StreamState s);

  std::unique_ptr<TokenSource> source_;
  StreamLoaderOptions opts_;
  StreamState state_;  // after the last batch returned
  int64_t order_epoch_ = -1;
  bool warned_short_epoch_ = false;  // the data is shorter than one sequence (said once)
  std::vector<size_t> order_;
  double wait_seconds_ = 0;
  int64_t batches_ = 0;

  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Batch> queue_;
  bool stop_ = false;
  bool end_ = false;
  std::exception_ptr error_;
};

// The unit order of an epoch: 0 … n−1, or a permutation fixed by (seed, epoch).
std::vector<size_t> epoch_order(size_t n, bool shuffle, uint64_t seed, int64_t epoch);

}  // namespace anvil
