// BPE training time on the Brown corpus (about 1M words) to vocab 2048, split
// into word counting (pre-tokenization) and the merges. Skipped when
// data/brown (or $ANVIL_BROWN_DIR) is missing; scripts/prepare_data.sh fetches it.
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "anvil/data/bpe_trainer.h"
#include "anvil/data/brown.h"

namespace {

const std::vector<anvil::TextDocument>* brown() {
  static const auto docs = [] {
    const char* env = std::getenv("ANVIL_BROWN_DIR");  // default: run from the repository root
    const std::string dir = env ? env : "data/brown";
    return std::filesystem::is_directory(dir) ? anvil::read_brown_corpus(dir) : std::vector<anvil::TextDocument>{};
  }();
  return &docs;
}

void BM_BpeCountWordsBrown(benchmark::State& state) {
  if (brown()->empty()) return state.SkipWithError("data/brown missing; run scripts/prepare_data.sh");
  int64_t words = 0, bytes = 0;
  for (auto _ : state) {
    anvil::WordCounter counter(anvil::kLlama3PreTokenizerPattern, {"<|begin_of_text|>", "<|end_of_text|>"});
    for (const auto& d : *brown()) counter.add_text(d.text);
    words = counter.total_words();
    bytes = counter.total_bytes();
  }
  state.counters["words"] = static_cast<double>(words);
  state.SetBytesProcessed(state.iterations() * bytes);
}
BENCHMARK(BM_BpeCountWordsBrown)->Unit(benchmark::kMillisecond)->Iterations(1);

void BM_BpeTrainBrown2048(benchmark::State& state) {
  if (brown()->empty()) return state.SkipWithError("data/brown missing; run scripts/prepare_data.sh");
  std::vector<std::string> texts;
  for (const auto& d : *brown()) texts.push_back(d.text);
  anvil::BpeTrainOptions opt;
  opt.vocab_size = 2048;
  for (auto _ : state) benchmark::DoNotOptimize(anvil::train_bpe(texts, opt));
}
BENCHMARK(BM_BpeTrainBrown2048)->Unit(benchmark::kMillisecond)->Iterations(1);

}  // namespace
