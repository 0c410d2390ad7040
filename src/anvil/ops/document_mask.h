// Block-causal masking over documents packed into sequences (torchtitan's
// attn_mask_type = "block_causal"): a token attends only to the tokens of its
// own document up to itself. The packing loader joins documents (BOS … EOS)
// end to end and cuts the stream into windows, so a window's documents are
// found from its tokens alone, as torchtitan finds them: a document ends at
// its EOS, and the token after an EOS starts the next. Position 0 of a window
// always starts one (the rest of a document begun in the window before).
//
// The mask is a (B, 2, T) i32 tensor of document bounds, the form the
// attention kernels read (ops/attention.h's AttentionWindow::documents):
// [b, 0, p] is the first position of the document holding position p of
// sequence b, [b, 1, p] the position after its last.
#pragma once
#include <cstdint>

#include "anvil/core/tensor.h"

namespace anvil {

// bounds (B, 2, T) from tokens (B, T), both i32, given the tokenizer's EOS id.
void fill_document_bounds(const Tensor& tokens, int32_t eos_id, Tensor& bounds);

// The bounds of sequences each holding one document (what causal attention
// sees): starts 0, ends T.
void fill_single_document_bounds(Tensor& bounds);

// The query-key pairs block-causal attention computes for the queries at
// positions [first, first + n) of sequence b: Σ (p − start(p) + 1). The causal
// mask's count of the same queries is Σ (p + 1).
int64_t document_attention_pairs(const Tensor& bounds, int64_t b, int64_t first, int64_t n);

// Documents in sequence b (the number of distinct starts).
int64_t documents_in(const Tensor& bounds, int64_t b);

}  // namespace anvil
