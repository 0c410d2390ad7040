#include "anvil/data/stream_loader.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>

#include "anvil/core/error.h"
#include "anvil/core/profiler.h"
#include "anvil/data/shard.h"

namespace anvil {

// ---- sources ----

ShardSource::ShardSource(std::vector<std::string> paths, uint64_t tokenizer_hash, int64_t vocab_size)
    : paths_(std::move(paths)), tokenizer_hash_(tokenizer_hash), vocab_size_(vocab_size) {
  ANVIL_CHECK(!paths_.empty(), "no shard files given; create them with anvil tokenize");
  for (const auto& p : paths_) counts_.push_back(ShardReader(p, tokenizer_hash_, vocab_size_).count());
}

ShardSource::~ShardSource() = default;

int64_t ShardSource::total_tokens() const {
  int64_t n = 0;
  for (int64_t c : counts_) n += c;
  return n;
}

int64_t ShardSource::read(size_t unit, int64_t offset, int64_t max_tokens, std::vector<int32_t>& out) {
  if (offset >= counts_[unit]) return -1;
  if (open_ == nullptr || open_unit_ != unit) {
    open_ = std::make_unique<ShardReader>(paths_[unit], tokenizer_hash_, vocab_size_);
    open_unit_ = unit;
  }
  const int64_t n = std::min(max_tokens, counts_[unit] - offset);
  open_->read(offset, n, out);
  return offset + n;
}

int64_t TokenVectorSource::read(size_t, int64_t offset, int64_t max_tokens, std::vector<int32_t>& out) {
  const int64_t size = static_cast<int64_t>(tokens_.size());
  if (offset >= size) return -1;
  const int64_t n = std::min(max_tokens, size - offset);
  out.insert(out.end(), tokens_.begin() + offset, tokens_.begin() + offset + n);
  return offset + n;
}

DocumentTokenSource::DocumentTokenSource(const std::vector<std::string>& inputs, SourceOptions opts,
                                         const Tokenizer& tokenizer)
    : opts_(std::move(opts)), tokenizer_(tokenizer) {
  files_ = expand_inputs(inputs, opts_, stats_);
  ANVIL_CHECK(!files_.empty(), "no input files to read documents from");
}

int64_t DocumentTokenSource::read(size_t unit, int64_t offset, int64_t, std::vector<int32_t>& out) {
  if (open_ == nullptr || open_unit_ != unit || open_docs_ != offset) {
    // Resuming mid-file: reopen it and pass over the documents already read.
    open_ = std::make_unique<FileDocuments>(files_[unit], opts_, stats_);
    open_unit_ = unit;
    open_docs_ = 0;
    while (open_docs_ < offset && open_->next(text_)) ++open_docs_;
    if (open_docs_ < offset) return -1;  // the file got shorter
  }
  if (!open_->next(text_)) return -1;
  ++open_docs_;
  // A tokenizer without BOS or EOS (id -1) joins the documents without them.
  if (tokenizer_.bos_id() >= 0) out.push_back(tokenizer_.bos_id());
  const std::vector<int32_t> ids = tokenizer_.encode(text_);
  out.insert(out.end(), ids.begin(), ids.end());
  if (tokenizer_.eos_id() >= 0) out.push_back(tokenizer_.eos_id());
  return open_docs_;
}

// ---- unit order ----

std::vector<size_t> epoch_order(size_t n, bool shuffle, uint64_t seed, int64_t epoch) {
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = i;
  if (!shuffle) return order;
  // mt19937_64's output is fixed by the standard; the Fisher-Yates steps are written
  // here (std::shuffle's are implementation-defined), so the order is the same everywhere.
  std::mt19937_64 rng(seed * 0x9e3779b97f4a7c15ull + static_cast<uint64_t>(epoch) + 1);
  for (size_t i = n; i > 1; --i) {
    const size_t j = static_cast<size_t>(rng() % i);
    std::swap(order[i - 1], order[j]);
  }
  return order;
}

// ---- loader ----

StreamLoader::StreamLoader(std::unique_ptr<TokenSource> source, StreamLoaderOptions opts)
    : source_(std::move(source)), opts_(opts) {
  ANVIL_ASSERT(source_ != nullptr);
  ANVIL_CHECK(opts_.seq_len > 0 && opts_.batch_size > 0, "the loader needs seq_len > 0 and batch_size > 0 (got ",
              opts_.seq_len, " and ", opts_.batch_size, ")");
  ANVIL_CHECK(opts_.world >= 1 && opts_.rank >= 0 && opts_.rank < opts_.world, "data-parallel rank ", opts_.rank,
              " is outside a world of ", opts_.world);
  ANVIL_CHECK(source_->num_units() > 0, "the dataset has no files");
  state_.next_window = opts_.rank;
}

StreamLoader::~StreamLoader() { stop_prefetch(); }

const std::vector<size_t>& StreamLoader::order(int64_t epoch) {
  if (epoch != order_epoch_) {
    order_ = epoch_order(source_->num_units(), opts_.shuffle, opts_.seed, epoch);
    order_epoch_ = epoch;
  }
  return order_;
}

void StreamLoader::drop_before(StreamState& s, int64_t pos) {
  if (s.stream_pos >= pos) return;
  const auto k = static_cast<size_t>(std::min<int64_t>(pos - s.stream_pos, static_cast<int64_t>(s.carry.size())));
  s.carry.erase(s.carry.begin(), s.carry.begin() + static_cast<std::ptrdiff_t>(k));
  s.stream_pos += static_cast<int64_t>(k);
}

bool StreamLoader::ensure(StreamState& s, int64_t begin, int64_t end) {
  drop_before(s, begin);
  const int64_t units = static_cast<int64_t>(source_->num_units());
  while (s.stream_pos + static_cast<int64_t>(s.carry.size()) < end) {
    const int64_t cursor = s.stream_pos + static_cast<int64_t>(s.carry.size());
    if (s.unit >= units) {  // the epoch is done: the stream runs on into the next
      ANVIL_CHECK(cursor > s.epoch_start, "the dataset holds no tokens (", units,
                  " file(s), every one empty or skipped)");
      // Less data than one sequence trains on the same tokens over and over: legal, but never silent.
      const int64_t epoch_tokens = cursor - s.epoch_start, row = opts_.seq_len + 1;
      if (epoch_tokens < row && !warned_short_epoch_) {
        warned_short_epoch_ = true;
        std::printf("anvil: warning: %s holds %lld tokens, fewer than one sequence (seq_len + 1 = %lld): every "
                    "sequence repeats it about %.1f times. Give more text, or lower training.seq_len\n",
                    opts_.what.c_str(), static_cast<long long>(epoch_tokens), static_cast<long long>(row),
                    static_cast<double>(row) / static_cast<double>(epoch_tokens));
        std::fflush(stdout);
      }
      if (opts_.max_epochs > 0 && s.epoch + 1 >= opts_.max_epochs) return false;
      ++s.epoch;
      s.unit = 0;
      s.offset = 0;
      s.epoch_start = cursor;
      continue;
    }
    const size_t u = order(s.epoch)[static_cast<size_t>(s.unit)];
    const int64_t known = source_->unit_tokens(u);
    if (s.carry.empty() && cursor < begin && known >= 0) {
      // Other ranks' windows: step over them without reading.
      const int64_t skip = std::min(begin - cursor, known - s.offset);
      s.offset += skip;
      s.stream_pos += skip;
      if (s.offset >= known) {
        ++s.unit;
        s.offset = 0;
      }
      continue;
    }
    const int64_t next = source_->read(u, s.offset, end - cursor, s.carry);
    if (next < 0) {
      ++s.unit;
      s.offset = 0;
    } else {
      s.offset = next;
    }
    drop_before(s, begin);
  }
  return true;
}

bool StreamLoader::produce(StreamState& s, Batch& b) {
  const int64_t S = opts_.seq_len, B = opts_.batch_size;
  b.inputs.resize(static_cast<size_t>(B * S));
  b.targets.resize(static_cast<size_t>(B * S));
  for (int64_t row = 0; row < B; ++row) {
    const int64_t begin = s.next_window * S;
    if (!ensure(s, begin, begin + S + 1)) return false;
    const int32_t* w = s.carry.data() + (begin - s.stream_pos);
    std::copy(w, w + S, b.inputs.begin() + row * S);
    std::copy(w + 1, w + S + 1, b.targets.begin() + row * S);
    s.next_window += opts_.world;
    drop_before(s, s.next_window * S);  // keep the carry (and the saved state) small
  }
  b.after = s;
  return true;
}

void StreamLoader::prefetch_loop(StreamState s) {
  Profiler::instance().set_thread_name("data prefetch");
  for (;;) {
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stop_ || queue_.empty(); });  // one batch ahead
      if (stop_) return;
    }
    Batch b;
    bool ok = false;
    try {
      const ScopedPhase phase(SpanCategory::data, "data.prefetch");
      ok = produce(s, b);
    } catch (...) {
      std::lock_guard lock(mu_);
      error_ = std::current_exception();
      cv_.notify_all();
      return;
    }
    std::lock_guard lock(mu_);
    if (!ok) {
      end_ = true;
      cv_.notify_all();
      return;
    }
    queue_.push_back(std::move(b));
    cv_.notify_all();
  }
}

void StreamLoader::start_prefetch() {
  stop_ = false;
  end_ = false;
  error_ = nullptr;
  queue_.clear();
  thread_ = std::thread(&StreamLoader::prefetch_loop, this, state_);
}

void StreamLoader::stop_prefetch() {
  if (!thread_.joinable()) return;
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
  queue_.clear();
  end_ = false;
  error_ = nullptr;
}

bool StreamLoader::next(std::vector<int32_t>& inputs, std::vector<int32_t>& targets) {
  const auto t0 = std::chrono::steady_clock::now();
  Batch b;
  bool ok;
  if (!opts_.prefetch) {
    StreamState s = state_;
    ok = produce(s, b);
  } else {
    if (!thread_.joinable()) start_prefetch();
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return !queue_.empty() || end_ || error_ != nullptr; });
    if (!queue_.empty()) {
      b = std::move(queue_.front());
      queue_.pop_front();
      ok = true;
      cv_.notify_all();
    } else if (error_ != nullptr) {
      std::exception_ptr e = error_;
      lock.unlock();
      stop_prefetch();  // a later call retries from the last good state
      std::rethrow_exception(e);
    } else {
      ok = false;
    }
  }
  wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!ok) return false;
  state_ = std::move(b.after);
  inputs = std::move(b.inputs);
  targets = std::move(b.targets);
  ++batches_;
  return true;
}

bool StreamLoader::next_batch(Tensor& tokens, Tensor& targets) {
  ANVIL_ASSERT(tokens.dtype() == DType::i32 && targets.dtype() == DType::i32);
  ANVIL_ASSERT(tokens.size(0) == opts_.batch_size && tokens.size(1) == opts_.seq_len &&
               targets.shape() == tokens.shape());
  std::vector<int32_t> in, tg;
  if (!next(in, tg)) return false;
  std::copy(in.begin(), in.end(), tokens.data<int32_t>());
  std::copy(tg.begin(), tg.end(), targets.data<int32_t>());
  return true;
}

void StreamLoader::set_state(const StreamState& s) {
  stop_prefetch();
  state_ = s;
}

nlohmann::json StreamLoader::state_json() const {
  const auto& s = state_;
  const auto ord = epoch_order(source_->num_units(), opts_.shuffle, opts_.seed, s.epoch);
  const bool in_unit = s.unit < static_cast<int64_t>(ord.size());
  return {{"version", 1},
          {"seq_len", opts_.seq_len},
          {"rank", opts_.rank},
          {"world", opts_.world},
          {"seed", opts_.seed},
          {"shuffle", opts_.shuffle},
          {"num_units", source_->num_units()},
          {"unit_name", in_unit ? source_->unit_name(ord[static_cast<size_t>(s.unit)]) : std::string()},
          {"epoch", s.epoch},
          {"unit", s.unit},
          {"offset", s.offset},
          {"stream_pos", s.stream_pos},
          {"epoch_start", s.epoch_start},
          {"next_window", s.next_window},
          {"carry", s.carry}};
}

void StreamLoader::load_state_json(const nlohmann::json& j) {
  StreamState s;
  try {
    ANVIL_CHECK(j.at("version").get<int>() == 1, "data loader state version ", j.at("version").dump(),
                ", this Anvil reads version 1");
    auto same = [&](const char* key, const nlohmann::json& now) {
      ANVIL_CHECK(j.at(key) == now, "the saved data loader state has ", key, " = ", j.at(key).dump(),
                  " but this run has ", now.dump(), "; resume with the same data settings and parallel layout");
    };
    same("seq_len", opts_.seq_len);
    same("seed", opts_.seed);
    same("shuffle", opts_.shuffle);
    same("num_units", source_->num_units());
    s.epoch = j.at("epoch").get<int64_t>();
    s.unit = j.at("unit").get<int64_t>();
    s.offset = j.at("offset").get<int64_t>();
    s.stream_pos = j.at("stream_pos").get<int64_t>();
    s.epoch_start = j.at("epoch_start").get<int64_t>();
    s.next_window = j.at("next_window").get<int64_t>();
    s.carry = j.at("carry").get<std::vector<int32_t>>();
    // Another data-parallel layout re-slices the stream. Rank 0's state marks
    // the first window no rank has read (its next one, every rank having read
    // as many) and keeps the stream from that window on, so any rank of any
    // world can continue from it: rank r's next window is that one plus r.
    const int saved_rank = j.at("rank").get<int>(), saved_world = j.at("world").get<int>();
    if (saved_rank != opts_.rank || saved_world != opts_.world) {
      ANVIL_CHECK(saved_rank == 0, "the saved data loader state is rank ", saved_rank, "'s of ", saved_world,
                  "; only rank 0's state can be re-sliced for another layout (rank ", opts_.rank, " of ",
                  opts_.world, ")");
      s.next_window += opts_.rank;
    }
  } catch (const nlohmann::json::exception& e) {
    throw Error(std::string("the saved data loader state is malformed (") + e.what() + ")");
  }
  ANVIL_CHECK(s.epoch >= 0 && s.unit >= 0 && s.offset >= 0 && s.unit <= static_cast<int64_t>(source_->num_units()) &&
                  s.next_window * opts_.seq_len >= s.stream_pos,
              "the saved data loader state is inconsistent (epoch ", s.epoch, ", unit ", s.unit, ", offset ", s.offset,
              ")");
  const auto ord = epoch_order(source_->num_units(), opts_.shuffle, opts_.seed, s.epoch);
  if (s.unit < static_cast<int64_t>(ord.size())) {
    const std::string name = source_->unit_name(ord[static_cast<size_t>(s.unit)]);
    ANVIL_CHECK(j.value("unit_name", std::string()) == name, "the saved data loader state was reading ",
                j.value("unit_name", std::string()), " but this run's dataset has ", name,
                " there; resume with the same dataset files");
  }
  set_state(s);
}

}  // namespace anvil
