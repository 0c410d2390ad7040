// Choosing the next token from a step's logits: greedy, or a draw from the
// softmax at a temperature, cut to the k most likely tokens and to the
// smallest set whose probability reaches p (nucleus sampling). The draw's
// random number comes from the counter-based generator (core/rng.h) keyed by
// the seed, the sequence's place in the batch and the step, so a seed gives
// the same text whatever else runs.
#pragma once
#include <cstdint>

namespace anvil {

struct SamplingOptions {
  float temperature = 0.8f;  // 0: greedy
  int64_t top_k = 0;         // 0: every token; 1: greedy
  float top_p = 1.0f;        // 1: no nucleus cut
  uint64_t seed = 0;
};

// Throws anvil::Error for a negative temperature or top_k, or top_p outside
// (0, 1], naming the flag.
void check_sampling_options(const SamplingOptions& options);

// The token of logits[0 .. V) to emit. Greedy (the highest logit, the lowest
// id on a tie) when temperature is 0 or top_k is 1; otherwise the draw `u`
// in [0, 1) picks from softmax(logits / temperature) over the tokens left
// after the top-k and top-p cuts, renormalised. Checks the options first.
int32_t sample_token(const float* logits, int64_t V, const SamplingOptions& options, float u);

// The uniform number sample_token draws with for sequence `sequence` at step
// `step` under `seed`.
float sampling_draw(uint64_t seed, int64_t sequence, int64_t step);

}  // namespace anvil
