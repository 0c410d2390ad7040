// BPE training time on Shakespeare's train works (data/shakespeare/train: 38
// files, 4.6 MB, about 0.8M whitespace-separated words) to vocab 2048, split
// into word counting (pre-tokenization) and the merges. The corpus is read with
// the project's own document source (every file below the folder, sorted by
// path, one plain text file = one document), which for this folder of .txt
// files is what `anvil tokenizer train --input data/shakespeare/train` counts.
// Skipped when data/shakespeare/train (or $ANVIL_CORPUS_DIR) is missing;
// scripts/prepare_data.sh fetches it.
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "anvil/data/bpe_trainer.h"
#include "anvil/data/text_source.h"

namespace {

const std::vector<std::string>* corpus() {
  static const auto docs = [] {
    const char* env = std::getenv("ANVIL_CORPUS_DIR");  // default: run from the repository root
    const std::string dir = env ? env : "data/shakespeare/train";
    std::vector<std::string> texts;
    if (!std::filesystem::is_directory(dir)) return texts;
    // skip_bad: tokenizer train skips a folder's empty files rather than stopping.
    anvil::DocumentSource source({dir}, anvil::SourceOptions{.skip_bad = true});
    std::string text;
    while (source.next(text)) texts.push_back(text);
    return texts;
  }();
  return &docs;
}

constexpr const char* kMissing = "data/shakespeare/train (or $ANVIL_CORPUS_DIR) missing; run scripts/prepare_data.sh";

void BM_BpeCountWordsShakespeare(benchmark::State& state) {
  if (corpus()->empty()) return state.SkipWithError(kMissing);
  int64_t words = 0, bytes = 0;
  for (auto _ : state) {
    anvil::WordCounter counter(anvil::kLlama3PreTokenizerPattern, {"<|begin_of_text|>", "<|end_of_text|>"});
    for (const auto& text : *corpus()) counter.add_text(text);
    words = counter.total_words();
    bytes = counter.total_bytes();
  }
  state.counters["words"] = static_cast<double>(words);
  state.SetBytesProcessed(state.iterations() * bytes);
}
BENCHMARK(BM_BpeCountWordsShakespeare)->Unit(benchmark::kMillisecond)->Iterations(1);

void BM_BpeTrainShakespeare2048(benchmark::State& state) {
  if (corpus()->empty()) return state.SkipWithError(kMissing);
  anvil::BpeTrainOptions opt;
  opt.vocab_size = 2048;
  for (auto _ : state) benchmark::DoNotOptimize(anvil::train_bpe(*corpus(), opt));
}
BENCHMARK(BM_BpeTrainShakespeare2048)->Unit(benchmark::kMillisecond)->Iterations(1);

}  // namespace
