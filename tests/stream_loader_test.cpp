// The streaming loader: windows match a reference cut by hand from the shards,
// epochs run on, the union over 1, 2 and 4 ranks is the single-process stream, a
// saved and restored state continues at the exact token, and prefetching changes
// nothing but timing.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "anvil/core/error.h"
#include "anvil/data/shard.h"
#include "anvil/data/stream_loader.h"
#include "test_util.h"

namespace fs = std::filesystem;
using namespace anvil;

namespace {

constexpr int64_t kVocab = 1 << 20;  // ids unique across the dataset (uint32 shards)
constexpr uint64_t kHash = 0x1234;
const std::vector<int64_t> kLengths = {37, 0, 1, 100, 53, 18};  // an empty and a one-token shard

struct Dataset {
  std::vector<std::string> paths;
  std::vector<std::vector<int32_t>> shards;
};

Dataset make_shards(const std::string& name, const std::vector<int64_t>& lengths = kLengths) {
  const fs::path d = anvil::testing::scratch_root() / "anvil_stream_loader_test" / name;
  fs::remove_all(d);
  fs::create_directories(d);
  Dataset ds;
  int32_t next = 1;
  for (size_t i = 0; i < lengths.size(); ++i) {
    std::vector<int32_t> ids;
    for (int64_t t = 0; t < lengths[i]; ++t) ids.push_back(next++);
    std::string file = "s";  // built in steps: GCC 12 warns falsely on "s" + to_string(i) (-Wrestrict)
    file += std::to_string(i);
    file += ".shard";
    const std::string p = (d / file).string();
    write_shard(p, ids, kHash, kVocab);
    ds.paths.push_back(p);
    ds.shards.push_back(ids);
  }
  return ds;
}

// The stream over `epochs` passes, each in that epoch's shard order.
std::vector<int32_t> reference(const Dataset& ds, bool shuffle, uint64_t seed, int epochs) {
  std::vector<int32_t> out;
  for (int e = 0; e < epochs; ++e)
    for (size_t u : epoch_order(ds.shards.size(), shuffle, seed, e))
      out.insert(out.end(), ds.shards[u].begin(), ds.shards[u].end());
  return out;
}

StreamLoaderOptions options(int64_t seq_len, int64_t batch, int rank = 0, int world = 1, bool shuffle = false,
                            bool prefetch = true) {
  StreamLoaderOptions o;
  o.seq_len = seq_len;
  o.batch_size = batch;
  o.rank = rank;
  o.world = world;
  o.seed = 1234;
  o.shuffle = shuffle;
  o.prefetch = prefetch;
  return o;
}

std::unique_ptr<StreamLoader> shard_loader(const Dataset& ds, const StreamLoaderOptions& o) {
  return std::make_unique<StreamLoader>(std::make_unique<ShardSource>(ds.paths, kHash, kVocab), o);
}

struct Batch {
  std::vector<int32_t> inputs, targets;
  bool operator==(const Batch&) const = default;
};

std::vector<Batch> take(StreamLoader& l, int n) {
  std::vector<Batch> out;
  for (int i = 0; i < n; ++i) {
    Batch b;
    EXPECT_TRUE(l.next(b.inputs, b.targets));
    out.push_back(std::move(b));
  }
  return out;
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(StreamLoader, WindowsMatchTheStreamAndEpochsWrap) {
  const Dataset ds = make_shards("wrap");
  for (bool shuffle : {false, true}) {
    const int64_t S = 16, B = 3;
    auto l = shard_loader(ds, options(S, B, 0, 1, shuffle));
    const auto ref = reference(ds, shuffle, 1234, 8);  // 209 tokens an epoch
    const auto batches = take(*l, 20);                  // 60 windows, 961 tokens: into the 5th epoch
    for (int64_t k = 0; k < 20; ++k)
      for (int64_t row = 0; row < B; ++row) {
        const int64_t g = k * B + row;
        const std::vector<int32_t> in(ref.begin() + g * S, ref.begin() + g * S + S);
        const std::vector<int32_t> tg(ref.begin() + g * S + 1, ref.begin() + g * S + S + 1);
        ASSERT_EQ(std::vector<int32_t>(batches[k].inputs.begin() + row * S, batches[k].inputs.begin() + row * S + S), in)
            << "shuffle " << shuffle << " batch " << k << " row " << row;
        ASSERT_EQ(std::vector<int32_t>(batches[k].targets.begin() + row * S, batches[k].targets.begin() + row * S + S),
                  tg);
      }
    EXPECT_EQ(l->state().epoch, 4);
    EXPECT_EQ(l->batches(), 20);
  }
  // The shuffled order changes from epoch to epoch and is fixed by the seed.
  bool differs = false;
  for (int e = 1; e < 5; ++e) differs |= epoch_order(6, true, 1234, e) != epoch_order(6, true, 1234, 0);
  EXPECT_TRUE(differs);
  EXPECT_EQ(epoch_order(6, true, 1234, 3), epoch_order(6, true, 1234, 3));
  EXPECT_NE(epoch_order(50, true, 1, 0), epoch_order(50, true, 2, 0));
}

TEST(StreamLoader, UnionOverRanksIsTheSingleStream) {
  const Dataset ds = make_shards("ranks");
  const int64_t S = 7, G = 8;
  for (bool shuffle : {false, true}) {
    auto single = shard_loader(ds, options(S, G, 0, 1, shuffle));
    const auto want = take(*single, 25);  // 200 windows: several epochs
    for (int world : {1, 2, 4}) {
      const int64_t B = G / world;
      for (int r = 0; r < world; ++r) {
        auto l = shard_loader(ds, options(S, B, r, world, shuffle, r % 2 == 0));
        const auto got = take(*l, 25);
        for (int k = 0; k < 25; ++k)
          for (int64_t j = 0; j < B; ++j) {
            const int64_t row = r + world * j;  // its row in the single-process batch
            ASSERT_TRUE(std::equal(got[k].inputs.begin() + j * S, got[k].inputs.begin() + (j + 1) * S,
                                   want[k].inputs.begin() + row * S))
                << "world " << world << " rank " << r << " batch " << k << " row " << j;
            ASSERT_TRUE(std::equal(got[k].targets.begin() + j * S, got[k].targets.begin() + (j + 1) * S,
                                   want[k].targets.begin() + row * S));
          }
      }
    }
  }
}

TEST(StreamLoader, ResumesAtTheExactToken) {
  const Dataset ds = make_shards("resume");
  const int64_t S = 9;
  for (int world : {1, 2}) {
    for (int stop_after : {0, 1, 6, 13}) {  // 13 batches cross an epoch boundary
      const int rank = world - 1;
      const auto o = options(S, 3, rank, world, /*shuffle=*/true);
      auto uninterrupted = shard_loader(ds, o);
      const auto want = take(*uninterrupted, stop_after + 12);

      auto first = shard_loader(ds, o);
      take(*first, stop_after);
      const std::string saved = first->state_json().dump();
      EXPECT_LE(first->state().carry.size(), static_cast<size_t>(S + 1));
      first.reset();  // the run stops; a new process resumes from the JSON

      auto resumed = shard_loader(ds, o);
      resumed->load_state_json(nlohmann::json::parse(saved));
      const auto got = take(*resumed, 12);
      for (int k = 0; k < 12; ++k)
        ASSERT_EQ(got[k], want[stop_after + k]) << "world " << world << " stopped after " << stop_after << ", batch " << k;
    }
  }
}

// A checkpoint holds data-parallel rank 0's state; a resume under another
// data-parallel size (1, 2 or 4 ranks from 2) re-slices the stream: the union of
// the new ranks' batches is the single-process continuation, across epochs.
TEST(StreamLoader, RankZerosStateResumesOnAnotherLayout) {
  const Dataset ds = make_shards("reslice");
  const int64_t S = 7, G = 8;
  for (bool shuffle : {false, true}) {
    auto single = shard_loader(ds, options(S, G, 0, 1, shuffle));
    const auto want = take(*single, 20);
    for (int stop_after : {0, 3, 11}) {
      auto saver = shard_loader(ds, options(S, G / 2, 0, 2, shuffle));
      take(*saver, stop_after);
      const nlohmann::json saved = saver->state_json();
      for (int world : {1, 2, 4}) {
        const int64_t B = G / world;
        for (int r = 0; r < world; ++r) {
          auto l = shard_loader(ds, options(S, B, r, world, shuffle, r % 2 == 0));
          l->load_state_json(saved);
          const auto got = take(*l, 20 - stop_after);
          for (int k = 0; k < 20 - stop_after; ++k)
            for (int64_t j = 0; j < B; ++j) {
              const int64_t row = r + world * j;
              ASSERT_TRUE(std::equal(got[k].inputs.begin() + j * S, got[k].inputs.begin() + (j + 1) * S,
                                     want[stop_after + k].inputs.begin() + row * S))
                  << "stopped after " << stop_after << ", world " << world << " rank " << r << " batch " << k;
            }
        }
      }
    }
  }
}

TEST(StreamLoader, ResumesDocumentsTokenizedOnTheFly) {
  const fs::path d = anvil::testing::scratch_root() / "anvil_stream_loader_test" / "docs";
  fs::remove_all(d);
  fs::create_directories(d);
  for (int f = 0; f < 4; ++f) {
    std::ofstream out(d / ("part" + std::to_string(f)).append(".jsonl"));
    for (int i = 0; i < 5 + f; ++i) out << "{\"text\": \"file " << f << " document " << i << std::string(i * 3, '!') << "\"}\n";
  }
  ByteTokenizer tok;
  auto make = [&](const StreamLoaderOptions& o) {
    return std::make_unique<StreamLoader>(
        std::make_unique<DocumentTokenSource>(std::vector<std::string>{(d / "*.jsonl").string()}, SourceOptions{}, tok), o);
  };
  const int64_t S = 32, G = 4;
  auto single = make(options(S, G, 0, 1, true));
  const auto want = take(*single, 30);
  // Rank slicing over documents.
  for (int r = 0; r < 2; ++r) {
    auto l = make(options(S, 2, r, 2, true));
    const auto got = take(*l, 30);
    for (int k = 0; k < 30; ++k)
      for (int j = 0; j < 2; ++j)
        ASSERT_TRUE(std::equal(got[k].inputs.begin() + j * S, got[k].inputs.begin() + (j + 1) * S,
                               want[k].inputs.begin() + (r + 2 * j) * S));
  }
  // The stream is BOS text EOS per document.
  EXPECT_EQ(want[0].inputs[0], tok.bos_id());
  // Stop mid-file, resume in a new loader.
  auto first = make(options(S, G, 0, 1, true));
  take(*first, 11);
  const nlohmann::json saved = first->state_json();
  EXPECT_GT(saved["offset"].get<int64_t>() + saved["unit"].get<int64_t>(), 0);
  auto resumed = make(options(S, G, 0, 1, true, false));
  resumed->load_state_json(saved);
  const auto got = take(*resumed, 19);
  for (int k = 0; k < 19; ++k) ASSERT_EQ(got[k], want[11 + k]) << k;
}

TEST(StreamLoader, PrefetchOnAndOffGiveTheSameBatches) {
  const Dataset ds = make_shards("prefetch");
  auto on = shard_loader(ds, options(5, 4, 1, 2, true, true));
  auto off = shard_loader(ds, options(5, 4, 1, 2, true, false));
  EXPECT_EQ(take(*on, 40), take(*off, 40));
  EXPECT_EQ(on->state(), off->state());
  // Restoring a state while a batch is prefetched discards the prefetched one.
  const StreamState s = off->state();
  take(*on, 3);
  on->set_state(s);
  EXPECT_EQ(take(*on, 5), take(*off, 5));
  // Tensors get the same values as vectors.
  Tensor tokens = Tensor::empty({4, 5}, DType::i32, MemCategory::workspace, "test.tokens");
  Tensor targets = Tensor::empty({4, 5}, DType::i32, MemCategory::workspace, "test.targets");
  ASSERT_TRUE(on->next_batch(tokens, targets));
  const Batch b = take(*off, 1)[0];
  EXPECT_TRUE(std::equal(b.inputs.begin(), b.inputs.end(), tokens.data<int32_t>()));
  EXPECT_TRUE(std::equal(b.targets.begin(), b.targets.end(), targets.data<int32_t>()));
}

TEST(StreamLoader, MaxEpochsEndsTheStream) {
  const Dataset ds = make_shards("epochs");  // 209 tokens: windows 0 … 12 of seq_len 16 fit
  for (bool prefetch : {false, true}) {
    auto o = options(16, 2, 0, 1, false, prefetch);
    o.max_epochs = 1;
    auto l = shard_loader(ds, o);
    std::vector<int32_t> in, tg;
    int n = 0;
    while (l->next(in, tg)) ++n;
    EXPECT_EQ(n, 6);  // 13 windows make 6 whole batches
    EXPECT_FALSE(l->next(in, tg));
  }
}

TEST(StreamLoader, BadStatesAndDataAreExplained) {
  const Dataset ds = make_shards("errors");
  auto l = shard_loader(ds, options(8, 2));
  take(*l, 3);
  const nlohmann::json saved = l->state_json();
  auto other = shard_loader(ds, options(16, 2));
  EXPECT_NE(error_of([&] { other->load_state_json(saved); }).find("seq_len = 8 but this run has 16"), std::string::npos);
  // Only rank 0's state (the whole stream's position) moves to another rank or layout.
  auto rank1 = shard_loader(ds, options(8, 1, 1, 2));
  take(*rank1, 2);
  const nlohmann::json saved_by_rank1 = rank1->state_json();
  auto rank0 = shard_loader(ds, options(8, 1, 0, 2));
  EXPECT_NE(error_of([&] { rank0->load_state_json(saved_by_rank1); }).find("rank 1 of 2"), std::string::npos);
  // The same number of files under other names: the dataset changed.
  Dataset renamed = make_shards("errors_renamed");
  auto moved = shard_loader(renamed, options(8, 2));
  EXPECT_NE(error_of([&] { moved->load_state_json(saved); }).find("resume with the same dataset files"),
            std::string::npos);
  EXPECT_NE(error_of([&] { l->load_state_json(nlohmann::json{{"version", 1}}); }).find("malformed"), std::string::npos);

  // Nothing but empty shards: an error, not an endless loop.
  const Dataset empty = make_shards("empty", {0, 0});
  auto none = shard_loader(empty, options(4, 1));
  std::vector<int32_t> in, tg;
  EXPECT_NE(error_of([&] { none->next(in, tg); }).find("holds no tokens"), std::string::npos);

  // An id outside the vocabulary, found by the prefetch thread, reaches the caller.
  const Dataset big = make_shards("oov", {10, 10});
  auto oov = std::make_unique<StreamLoader>(std::make_unique<ShardSource>(big.paths, kHash, 15), options(4, 1));
  const std::string e = error_of([&] {
    for (int i = 0; i < 10; ++i) oov->next(in, tg);
  });
  EXPECT_NE(e.find("s1.shard: token 4 "), std::string::npos) << e;  // id 15 is token 4 of the second shard
  EXPECT_NE(error_of([&] { ShardSource(big.paths, kHash + 1, kVocab); }).find("another tokenizer"), std::string::npos);
}
