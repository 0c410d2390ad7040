// The compute prediction: floating-point operations per trained token, the
// numerator of throughput in TFLOP/s and of MFU (torchtitan's definition, so
// the figures compare with its logs). Beside estimate/memory.h, the other prediction.
#pragma once
#include <cstdint>

#include "anvil/model/args.h"

namespace anvil {

// 6·(parameters − embedding parameters) + 6·n_layers·n_heads·2·head_dim·seq_len:
// the matrix products of forward and backward (3 × 2 FLOPs per weight per
// token) plus attention's scores and weighted sum, causal mask not discounted.
// Where the flavour ties the head to the embedding (Llama 3.2 1B, 3B) the
// head's vocab × dim product still counts: the parameters are shared, the
// work is not.
double flops_per_token(const ModelArgs& args, int64_t seq_len);

// The share of causal attention's query-key pairs block-causal attention
// computes over documents of `mean_document_tokens` packed end to end and cut
// into sequences of seq_len: a query sees the keys from its document's start,
// or from the sequence's, whichever is later, with the documents' offsets
// against the sequences uniform. 1 at mean_document_tokens = 0 (documents no
// shorter than the sequences: the causal work, an upper bound); about
// mean / seq_len for short documents. The time models scale attention by it;
// FLOPs per token and MFU do not (torchtitan counts the unmasked work).
double block_causal_share(int64_t seq_len, double mean_document_tokens);

}  // namespace anvil
