// Fused LM head + cross-entropy: logits = x·wᵀ, loss = Σ_rows −log softmax(logits)[target],
// and its gradients, without ever holding the (M, V) logits. Rows are processed in
// blocks and the vocabulary in chunks; only one row-block × vocab-chunk of f32
// logits exists at a time.
#pragma once
#include <cstdint>

#include "anvil/core/tensor.h"

namespace anvil {

// Defaults for the blocking (tuned on AMX: large enough blocks that each product reuses its reordered
// weight chunk over many rows, small enough chunks that the products keep their operands dense).
inline constexpr int64_t kCrossEntropyRowBlock = 2048;
inline constexpr int64_t kCrossEntropyVocabChunk = 1024;

struct CrossEntropyOptions {
  // Rows whose target equals this contribute no loss, no token count and no gradient.
  int32_t ignore_index = -100;
  // Tokens per row block and vocabulary entries per chunk; 0 picks the defaults above.
  // Tests set small values to exercise the edges.
  int64_t row_block = 0;
  int64_t vocab_chunk = 0;
};

struct CrossEntropyResult {
  double loss_sum = 0;     // Σ over counted rows of −log softmax(x·wᵀ)[target]  (not averaged)
  int64_t num_tokens = 0;  // rows whose target != ignore_index
};

// Evaluation: the loss only.
// x       (M, D)  final-norm output, f32 or bf16
// w       (V, D)  output weight, same dtype as x
// targets (M)     i32 token ids in [0, V), or ignore_index
CrossEntropyResult cross_entropy_forward(const Tensor& x, const Tensor& w, const Tensor& targets,
                                         const CrossEntropyOptions& opt = {});

// Training: the loss and both gradients of grad_scale · loss_sum.
// x       (M, D)  final-norm output, f32 or bf16
// w       (V, D)  output weight, same dtype as x
// targets (M)     i32 token ids in [0, V), or ignore_index
// dx      (M, D)  written (overwritten): grad_scale · ∂loss_sum/∂x; rows of ignored targets are zero.
//                 f32 or bf16.
// dw      (V, D)  accumulated (+=): grad_scale · ∂loss_sum/∂w. f32 or bf16 (f32 in mixed precision).
// grad_scale      the caller's normalisation, e.g. 1 / (tokens in the whole step), so that
//                 gradient accumulation over micro-batches equals one big batch.
// Targets are validated before anything is written: on an out-of-range id it throws
// anvil::Error and dx, dw are untouched.
CrossEntropyResult cross_entropy_forward_backward(const Tensor& x, const Tensor& w, const Tensor& targets,
                                                  float grad_scale, Tensor& dx, Tensor& dw,
                                                  const CrossEntropyOptions& opt = {});

}  // namespace anvil
