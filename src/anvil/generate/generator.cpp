#include "anvil/generate/generator.h"

#include <algorithm>
#include <chrono>

#include "anvil/core/error.h"

namespace anvil {

namespace {
using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
}  // namespace

Generation generate(Llama& model, const std::vector<std::vector<int32_t>>& prompts, const GenerateOptions& options,
                    const std::function<void(size_t, int32_t)>& on_token) {
  const int64_t context = model.max_seq_len(), V = model.args().vocab_size;
  ANVIL_CHECK(!prompts.empty(), "no prompt to continue");
  ANVIL_CHECK(options.max_new_tokens >= 1, "--max_new_tokens ", options.max_new_tokens, " must be at least 1");
  check_sampling_options(options.sampling);
  int64_t longest = 0;
  for (size_t b = 0; b < prompts.size(); ++b) {
    const int64_t n = static_cast<int64_t>(prompts[b].size());
    ANVIL_CHECK(n >= 1, "prompt ", b + 1, " has no tokens");
    ANVIL_CHECK(n < context, "prompt ", b + 1, " is ", n, " tokens, but the model's context is ", context,
                " tokens: nothing is left to generate into; shorten the prompt");
    for (const int32_t t : prompts[b])
      ANVIL_CHECK(t >= 0 && t < V, "prompt ", b + 1, " holds token ", t, ", outside the model's vocabulary of ", V);
    longest = std::max(longest, n);
  }
  const int64_t B = static_cast<int64_t>(prompts.size());
  const int64_t capacity = std::min(context, longest + options.max_new_tokens);
  KvCache cache(model.args(), B, capacity, model.compute_dtype());
  Generation out;
  out.tokens.resize(prompts.size());
  out.stats.cache_bytes = cache.bytes();
  std::vector<int64_t> length(prompts.size());
  std::vector<int32_t> last(prompts.size());
  std::vector<bool> done(prompts.size(), false);
  // One sequence's logits row → its next token; records and reports it.
  auto emit = [&](size_t b, const Tensor& logits_f32, int64_t row) {
    const int64_t step = static_cast<int64_t>(out.tokens[b].size());
    const int32_t t = sample_token(logits_f32.data<float>() + row * V, V, options.sampling,
                                   sampling_draw(options.sampling.seed, static_cast<int64_t>(b), step));
    out.tokens[b].push_back(t);
    last[b] = t;
    if (on_token) on_token(b, t);
    const bool full = length[b] >= capacity;  // the new token would have no position to go in
    out.stats.context_full = out.stats.context_full || (full && length[b] >= context);
    done[b] = t == options.eos_id || static_cast<int64_t>(out.tokens[b].size()) >= options.max_new_tokens || full;
  };

  // Prefill: each prompt in its own pass (prompts differ in length), into its slot.
  const auto t_prefill = Clock::now();
  for (size_t b = 0; b < prompts.size(); ++b) {
    const int64_t n = static_cast<int64_t>(prompts[b].size());
    Tensor tokens = Tensor::empty({1, n}, DType::i32, MemCategory::activations, "generate.prompt");
    std::copy(prompts[b].begin(), prompts[b].end(), tokens.data<int32_t>());
    const Tensor logits = model.forward_cached(tokens, {static_cast<int64_t>(b)}, {0}, cache)
                              .to(DType::f32, MemCategory::activations, "generate.logits");
    length[b] = n;
    out.stats.prompt_tokens += n;
    emit(b, logits, 0);
  }
  out.stats.prefill_seconds = seconds_since(t_prefill);

  // Decode: every unfinished sequence's last token at its own position, in one pass.
  const auto t_decode = Clock::now();
  for (;;) {
    std::vector<int64_t> slots, positions;
    for (size_t b = 0; b < prompts.size(); ++b)
      if (!done[b]) slots.push_back(static_cast<int64_t>(b)), positions.push_back(length[b]);
    if (slots.empty()) break;
    Tensor tokens =
        Tensor::empty({static_cast<int64_t>(slots.size()), 1}, DType::i32, MemCategory::activations, "generate.tokens");
    for (size_t i = 0; i < slots.size(); ++i) tokens.data<int32_t>()[i] = last[static_cast<size_t>(slots[i])];
    const Tensor logits = model.forward_cached(tokens, slots, positions, cache)
                              .to(DType::f32, MemCategory::activations, "generate.logits");
    for (size_t i = 0; i < slots.size(); ++i) {
      const size_t b = static_cast<size_t>(slots[i]);
      ++length[b];
      emit(b, logits, static_cast<int64_t>(i));
    }
  }
  out.stats.decode_seconds = seconds_since(t_decode);
  for (const std::vector<int32_t>& t : out.tokens) out.stats.generated_tokens += static_cast<int64_t>(t.size());
  return out;
}

}  // namespace anvil
