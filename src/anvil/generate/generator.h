// Text from a model: each prompt's tokens go through the model once (prefill),
// filling its slot of a key/value cache, then every step feeds each unfinished
// sequence's last token at its position and samples the next from the
// logits (decode). The sequences of a batch decode together: one pass of the
// weights serves every sequence's new token, which is what makes a batch
// cheaper per token than one sequence at a time.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

#include "anvil/generate/sampler.h"
#include "anvil/model/llama.h"

namespace anvil {

struct GenerateOptions {
  int64_t max_new_tokens = 64;
  SamplingOptions sampling;
  int32_t eos_id = -1;  // a sequence ends when it emits this token (-1: never)
};

struct GenerateStats {
  int64_t prompt_tokens = 0, generated_tokens = 0;
  double prefill_seconds = 0, decode_seconds = 0;  // decode: every step after the first token
  size_t cache_bytes = 0;
  bool context_full = false;  // some sequence stopped at the model's context
};

struct Generation {
  std::vector<std::vector<int32_t>> tokens;  // the new tokens of each prompt (its EOS included when it ended)
  GenerateStats stats;
};

// Generates up to max_new_tokens after each prompt (each at least one token
// long and shorter than the model's context; throws anvil::Error naming the
// prompt otherwise), stopping a sequence at EOS or at the model's context.
// on_token(sequence, token), if given, sees every new token as it is chosen.
Generation generate(Llama& model, const std::vector<std::vector<int32_t>>& prompts, const GenerateOptions& options,
                    const std::function<void(size_t, int32_t)>& on_token = {});

}  // namespace anvil
