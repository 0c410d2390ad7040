// Encode throughput of the Llama 3 BPE tokenizer, one thread, in MB/s of
// UTF-8 input: on Shakespeare's train works (data/shakespeare/train, one
// document per work) and on a mixed text (code, numbers, whitespace runs,
// emoji, CJK, accented Latin). "cold" starts every pass with an empty piece
// cache (a freshly loaded tokenizer); "warm" reuses it, as a long tokenize run
// does. Needs data/tokenizers/llama3/tokenizer.json
// (scripts/prepare_llama3_tokenizer.sh) and data/shakespeare (scripts/prepare_data.sh).
#include <filesystem>
#include <memory>

#include "anvil/data/bpe_tokenizer.h"
#include "anvil/data/text_source.h"
#include "ceilings.h"

namespace {

namespace fs = std::filesystem;
const fs::path kRoot = fs::path(__FILE__).parent_path().parent_path();
const std::string kTokenizer = (kRoot / "data/tokenizers/llama3/tokenizer.json").string();
const fs::path kShakespeare = kRoot / "data/shakespeare/train";

// The works as the text dataset reads them: every file, sorted, one document each.
std::vector<std::string> shakespeare_text() {
  std::vector<std::string> docs;
  anvil::DocumentSource source({kShakespeare.string()}, anvil::SourceOptions{});
  std::string text;
  while (source.next(text)) docs.push_back(text);
  return docs;
}

std::vector<std::string> mixed_text() {
  const char* parts[] = {"The committee's report wasn't published until Tuesday; they'd reviewed it. ",
                         "for (int i = 0; i < n; ++i) {\n\tsum += a[i] * 0x1F;\n}\n",
                         "    return fib(n - 1) + fib(n - 2)\n\n",
                         "3.14159 2,718,281 -42e7 ",
                         "🦙🔥👍🏽 ",
                         "中文文本的分词测试。日本語のテキスト、한국어 텍스트 ",
                         "Ça va? Élève naïve, São Paulo, Zürich, Straße. ",
                         "      \n\n\t\t  \r\n"};
  std::vector<std::string> docs;
  uint64_t s = 88172645463325252ull;
  for (int d = 0; d < 600; ++d) {
    std::string doc;
    while (doc.size() < 8000) {
      s ^= s << 13, s ^= s >> 7, s ^= s << 17;
      doc += parts[s % 8];
      doc += std::to_string(s % 100000);
    }
    docs.push_back(std::move(doc));
  }
  return docs;
}

void BM_TokenizerEncode(benchmark::State& state, bool shakespeare, bool warm) {
  if (!fs::exists(kTokenizer) || (shakespeare && !fs::is_directory(kShakespeare))) {
    state.SkipWithError("run scripts/prepare_llama3_tokenizer.sh and scripts/prepare_data.sh first");
    return;
  }
  const std::vector<std::string> docs = shakespeare ? shakespeare_text() : mixed_text();
  double bytes = 0;
  for (const auto& d : docs) bytes += static_cast<double>(d.size());
  std::unique_ptr<anvil::BpeTokenizer> tok = anvil::BpeTokenizer::load(kTokenizer);
  size_t tokens = 0, passes = 0;
  auto pass = [&] {
    for (const auto& d : docs) tokens += tok->encode(d).size();
    ++passes;
  };
  if (warm) {
    anvil::bench::run_and_report(state, pass, 0, bytes);
  } else {
    const anvil::bench::Ceilings before = anvil::bench::measure_ceilings();
    double seconds = 0;
    for (auto _ : state) {
      state.PauseTiming();
      tok = anvil::BpeTokenizer::load(kTokenizer);  // a new instance starts with an empty cache
      state.ResumeTiming();
      const auto t0 = std::chrono::steady_clock::now();
      pass();
      seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    anvil::bench::report(state, before, seconds, 0, bytes);
  }
  state.counters["MB"] = benchmark::Counter(bytes / 1e6 * static_cast<double>(state.iterations()),
                                              benchmark::Counter::kIsRate);
  state.counters["bytes/token"] = bytes * static_cast<double>(passes) / static_cast<double>(tokens);
}

BENCHMARK_CAPTURE(BM_TokenizerEncode, shakespeare_cold, true, false)->Iterations(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_TokenizerEncode, shakespeare_warm, true, true)->Iterations(3)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_TokenizerEncode, mixed_cold, false, false)->Iterations(2)->Unit(benchmark::kMillisecond)->UseRealTime();
BENCHMARK_CAPTURE(BM_TokenizerEncode, mixed_warm, false, true)->Iterations(3)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
