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

// The backward keeps a row block's logits of every chunk from the first pass
// for the second, instead of computing them again, when at least
// kCrossEntropyKeptRowsMin rows fit in kCrossEntropyKeptLogitsBytes of f32
// logits (the row block shrinks to what fits): recomputing costs a quarter of
// the head's work (8·M·V·D against 6), the smaller blocks only re-read dw
// more often. A vocabulary too large for that (128k entries keep 131 rows)
// recomputes, in blocks of kCrossEntropyRowBlock rows.
inline constexpr int64_t kCrossEntropyKeptLogitsBytes = int64_t{64} << 20;
inline constexpr int64_t kCrossEntropyKeptRowsMin = 256;

enum class KeepLogits : uint8_t { automatic, keep, recompute };

struct CrossEntropyOptions {
  // Rows whose target equals this contribute no loss, no token count and no gradient.
  int32_t ignore_index = -100;
  // Tokens per row block and vocabulary entries per chunk; 0 picks the defaults above.
  // Tests set small values to exercise the edges.
  int64_t row_block = 0;
  int64_t vocab_chunk = 0;
  // Whether the backward keeps the first pass's logits; tests force either way.
  KeepLogits keep_logits = KeepLogits::automatic;
};

// How the fused kernel blocks an (M, D) × (V, D) head: rows per block, vocabulary
// entries per chunk, and whether the backward keeps every chunk's logits of a
// block (its f32 logits buffer is then rows × V, else rows × chunk).
struct CrossEntropyBlocking {
  int64_t rows = 0, chunk = 0;
  bool keep_logits = false;
};
CrossEntropyBlocking cross_entropy_blocking(int64_t M, int64_t V, bool backward, const CrossEntropyOptions& opt = {});
// The loss-parallel shard kernels' blocking (below): rows and chunk as the fused
// kernel's defaults, the logits always recomputed.
CrossEntropyBlocking cross_entropy_shard_blocking(int64_t M, int64_t V, const CrossEntropyOptions& opt = {});

struct CrossEntropyResult {
  double loss_sum = 0;     // Σ over counted rows of −log softmax(x·wᵀ)[target]  (not averaged)
  int64_t num_tokens = 0;  // rows whose target != ignore_index
};

// The rows of `targets` (host i32) that count: those not ignore_index, after
// checking each of them is in [0, V) (anvil::Error naming the first that is
// not). The op's own check, also made on the host before a batch is copied to
// a GPU, whose kernels cannot throw. A dry run has no targets: all M count.
int64_t count_targets(const Tensor& targets, int64_t V, int32_t ignore_index);

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

// ---- Loss parallel: the head split over vocabulary shards (tensor parallelism) ----
//
// Rank t of a tensor-parallel group holds rows [vocab_begin, vocab_begin + V_t)
// of the (vocab_size, D) output weight. The loss needs each row's log-sum-exp
// over the WHOLE vocabulary, which no rank can compute alone, and the full
// logits are never gathered. Instead, in two kernel calls with the caller's
// communication between them (the kernels do none):
//   1. cross_entropy_shard_stats: per row, over this shard's logits, the max m_t,
//      Σ exp(logit − m_t) and the target's logit when the target is in the shard.
//   2. the caller combines over the ranks: m = max_t m_t (an all-reduce max), then
//      S = Σ_t s_t·exp(m_t − m) and the target logit (one all-reduce sum; exactly
//      one shard holds the target, the others add 0); lse = m + log S and
//      loss_row = lse − logit[target] (cross_entropy_combine_rows below).
//   3. cross_entropy_shard_backward: with lse, this shard's softmax − onehot,
//      its dw rows (local, complete) and its term of dx = Σ_t dlogits_t·w_t (the
//      caller sums dx over the ranks).
// FLOPs per rank: 2·M·V_t·D for the stats, 6·M·V_t·D for the backward (it
// recomputes every chunk's logits: the stats' last chunk is gone by then).

// x       (M, D)  the final-norm output of every row (not sequence-sharded), f32 or bf16
// w       (V_t, D) this shard's rows, same dtype as x; rows past vocab_size must not be
//                  passed (the caller slices the vocabulary padding off); V_t may be 0
// targets (M)     i32 ids in [0, vocab_size), or ignore_index (checked: anvil::Error)
// stats   (3, M)  f32, written: [0] m_t (−inf when the shard is empty), [1] Σ exp(logit − m_t),
//                 [2] the target's logit if vocab_begin ≤ target < vocab_begin + V_t, else 0.
//                 Ignored rows: −inf, 0, 0.
// Returns the rows whose target is not ignore_index.
int64_t cross_entropy_shard_stats(const Tensor& x, const Tensor& w, const Tensor& targets, int64_t vocab_begin,
                                  int64_t vocab_size, Tensor& stats, const CrossEntropyOptions& opt = {});

// After the maxima are combined: global_max (M) = max over the shards' stats[0].
// Rescales this shard's Σexp to the global max in place, stats[1] *= exp(stats[0] − global_max)
// (0 for an empty shard or an ignored row), so a plain sum over the ranks of stats[1] is S.
void cross_entropy_rescale_sumexp(Tensor& stats, const Tensor& global_max, const Tensor& targets,
                                  const CrossEntropyOptions& opt = {});

// With the combined statistics: global_max (M) and stats (3, M) whose [1] and [2] are the sums
// over the ranks. Writes lse (M) f32 (0 for ignored rows) and returns the loss over the rows.
CrossEntropyResult cross_entropy_combine_rows(const Tensor& global_max, const Tensor& summed_stats,
                                              const Tensor& targets, Tensor& lse, const CrossEntropyOptions& opt = {});

// x, w, targets as for the stats; lse (M) f32 from cross_entropy_combine_rows.
// dx (M, D) f32 or bf16, written: this shard's term grad_scale · dlogits_t·w_t (zero rows for
//           ignored targets; all zero for an empty shard).
// dw (V_t, D) ACCUMULATED: grad_scale · dlogits_tᵀ·x, this shard's whole gradient.
void cross_entropy_shard_backward(const Tensor& x, const Tensor& w, const Tensor& targets, int64_t vocab_begin,
                                  const Tensor& lse, float grad_scale, Tensor& dx, Tensor& dw,
                                  const CrossEntropyOptions& opt = {});

}  // namespace anvil
