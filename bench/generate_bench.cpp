// Decoding with the key/value cache: one step (every sequence of a batch one
// new token at position 64, its logits to f32 and a greedy choice) for the
// debug model and 125M, bf16 and fp32, batch 1 and 8. A step reads every
// weight but the embedding table once, whatever the batch, so the bound is
// batch × memory bandwidth ÷ the weights' bytes; "vs_copy" is the step's
// weight bytes per second against the memory copy measured around it (the
// fraction of that bound reached), "tokens/s" the decode rate.
#include <algorithm>

#include "anvil/generate/sampler.h"
#include "anvil/model/llama.h"
#include "ceilings.h"

namespace {
using namespace anvil;

void BM_Decode(benchmark::State& state, const char* flavor, DType dtype) {
  const ModelArgs args = model_flavor("llama3", flavor);
  const int64_t B = state.range(0), pos = 64;
  Llama model(args, dtype, pos + 1);
  model.params().init(1);
  KvCache cache(args, B, pos + 1, dtype);
  Tensor tokens = Tensor::zeros({B, 1}, DType::i32, MemCategory::activations, "tokens");
  std::vector<int64_t> slots, positions(static_cast<size_t>(B), pos);
  for (int64_t b = 0; b < B; ++b) slots.push_back(b);
  // Each sequence's first 64 positions filled, as a prompt's prefill leaves them.
  const Tensor prompt = Tensor::zeros({1, pos}, DType::i32, MemCategory::activations, "prompt");
  for (int64_t b = 0; b < B; ++b) model.forward_cached(prompt, {b}, {0}, cache);
  const SamplingOptions greedy{0.0f, 0, 1.0f, 0};
  auto run = [&] {
    const Tensor logits =
        model.forward_cached(tokens, slots, positions, cache).to(DType::f32, MemCategory::activations, "logits");
    for (int64_t b = 0; b < B; ++b)
      tokens.data<int32_t>()[b] = sample_token(logits.data<float>() + b * args.vocab_size, args.vocab_size, greedy, 0);
  };
  const double weights =
      static_cast<double>(args.num_params() - (args.tie_embeddings ? 0 : args.num_embedding_params())) *
      static_cast<double>(dtype_size(dtype));
  bench::run_and_report(state, run, 0, weights);
  state.counters["tokens/s"] =
      benchmark::Counter(static_cast<double>(B), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["weight_MB"] = weights / 1e6;
  state.counters["bound_tokens/s"] = static_cast<double>(B) * state.counters["copy_ceiling"] * 1e9 / weights;
}

// name: the benchmark's (an identifier, which "125M" cannot start), flavor: the model's.
#define DECODE_BENCH(name, flavor, dt)                         \
  BENCHMARK_CAPTURE(BM_Decode, name##_##dt, flavor, DType::dt) \
      ->Arg(1)                                                 \
      ->Arg(8)                                                 \
      ->ArgName("batch")                                       \
      ->Unit(benchmark::kMillisecond)                          \
      ->MinTime(1.0)
DECODE_BENCH(debugmodel, "debugmodel", bf16);
DECODE_BENCH(debugmodel, "debugmodel", f32);
DECODE_BENCH(llama3_125M, "125M", bf16);
DECODE_BENCH(llama3_125M, "125M", f32);
}  // namespace
