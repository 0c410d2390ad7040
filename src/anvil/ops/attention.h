// Causal self-attention with grouped-query heads, computed flash-attention
// style: scores are produced and consumed one (query tile × key tile) block at
// a time, so no T×T matrix is ever stored. Forward and backward, f32 and bf16
// storage (bf16: scores and softmax in f32, matrix products on AMX).
//
// Layout is what the q/k/v projections produce (the caller transposes nothing):
//   q    (B, T, Hq,  D)
//   k, v (B, T, Hkv, D)     Hq is a multiple of Hkv; query head h reads kv head
//                           h / (Hq / Hkv) (grouped-query attention; Hkv = Hq is
//                           plain multi-head, Hkv = 1 multi-query)
//   out  (B, T, Hq,  D)
//   lse  (B, Hq, T) f32     log Σ_j exp(scale · q_t·k_j) over keys j ≤ t: the only
//                           softmax statistic the backward needs
// Query t attends to keys 0..t. scale defaults to 1/sqrt(D).
//
// Documents packed into one sequence (block-causal attention): with
// AttentionWindow::documents, query t attends only to the keys of its own
// document up to itself. Whole tiles the mask removes are skipped (a sequence
// of short documents costs less than a causal one); tiles it cuts through are
// computed and masked per row. A sequence of short documents runs on a finer
// grid of tiles (AttentionTiles::doc), one of one document on the causal grid,
// and so gives bit for bit the causal result. Tile starts stay on the grid,
// so the products take a fixed set of shapes and the workspace does not
// depend on the documents.
//
// Part of a sequence (context parallelism: a rank holds some chunks of the
// queries): an AttentionWindow puts query row t at position q_first + t and
// key row j at k_first + j, and query t attends to the keys at positions up
// to its own. q then has Tq rows and k, v any Tk rows (only those up to the
// last query's position are read); lse is (B, Hq, Tq).
//
// Work is parallel over (batch, kv head) tasks, split further when B·Hkv does
// not divide over the threads. Workspace (category workspace, freed on
// return), per thread, with G = Hq/Hkv and s = dtype size:
//   forward   2·T·D·s (K, V rows of one kv head, packed densely for AMX)
//             + one block: Bq·Bk·(4 + s) + Bq·D·(4 + s)
//   backward  (2 + 2G)·T·D·s (K, V, and Q, dout of the group) + G·T·D·4 (dQ
//             accumulator) + 8·G·T + two blocks: Bq·Bk·(8 + 2s) + 2·Bk·D·4
//   plus, only with several splits per kv head, a (B, T, Hq, D) f32 dQ sum.
#pragma once
#include <cstdint>

#include "anvil/core/tensor.h"

namespace anvil {

// Tile sizes: query rows × keys per block. Each tile product is one oneDNN
// call with a fixed cost of a few µs, so blocks are large. Blocks on the
// causal diagonal are half wasted, so the tile along the diagonal (forward:
// queries, backward: keys) is also capped at max(64, T/4). Defaults measured
// with bench/attention_bench.cpp at D = 128 (T = 512 and 2048); tests pass
// small tiles to cover the multi-tile paths on small T. Any positive sizes
// work, T need not be a multiple of them.
struct AttentionTiles {
  int64_t fwd_q = 256, fwd_k = 512;  // forward
  int64_t bwd_q = 256, bwd_k = 256;  // backward
  // Under documents, a sequence of two or more documents averaging at most
  // 4·doc tokens runs on a finer grid (never coarser than the above): query
  // tiles of doc rows whose key blocks start on multiples of doc and run up
  // to fwd_k keys forward; key tiles of doc whose query tiles run up to bwd_q
  // rows and end within doc of the last query that sees them backward; fewer
  // of its tiles cross a document boundary. At seq 2048, 16 heads, documents
  // of 256 tokens, 128 takes attention forward and backward to 0.28–0.29 of
  // the causal time at head_dim 16 and 0.30 at 128 (the causal grid alone:
  // 0.47 and 0.45); 192 and 256 are slower, 64 faster by 10–20% but at a
  // higher cost per tile kept (bench/attention_bench.cpp,
  // BM_AttentionDocuments; docs/performance.md). A sequence of one
  // document keeps the causal tiles, and so the causal result bit for bit.
  int64_t doc = 128;
};

// Where the query and key rows sit in the sequence (see above), and the
// documents the sequences hold. q_first ≥ k_first.
//
// documents, when defined: (B, 2, S) i32 over whole sequences of S ≥ every
// row's position: [b, 0, p] is the first position of the document holding
// position p of sequence b, [b, 1, p] the position after its last (see
// data/documents.h). Undefined: one document per sequence (causal). Under
// documents a query may see none of the keys of a window (context
// parallelism's chunks): its out row is then 0 and its lse −∞, which
// attention_merge ignores.
struct AttentionWindow {
  int64_t q_first = 0, k_first = 0;
  Tensor documents = {};
};

// Which gradients the backward adds to instead of overwriting.
struct AttentionAccumulate {
  bool dq = false, dkv = false;
};

// scale = 0 means the usual 1/sqrt(D).
// q, k, v, out share a dtype (f32 or bf16); lse is always f32.
// Whether attention on `dtype` tensors packs its operands as f32 and runs its
// tile products in f32: for bf16 where bf16 products run widened (matmul.h),
// since a tile is too small to widen per product. The softmax is f32 either
// way; P and dS are then not rounded to bf16 before their products.
bool attention_products_widened(DType dtype);

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse, float scale = 0.0f,
                       const AttentionTiles& tiles = {}, const AttentionWindow& window = {});

// Gradients of the loss with respect to q, k and v, given dout = dL/dout.
// dq (B, T, Hq, D), dk and dv (B, T, Hkv, D) are overwritten, or added to
// as `accumulate` says (in f32, rounded once: the query chunks of a
// context-parallel rank add their keys' gradients into one buffer); keys no
// query sees get 0 when overwritten;
// dk and dv sum over the query heads that share each kv head. All of dout, q,
// k, v, out, dq, dk, dv share a dtype; lse is the forward's f32 output. The
// softmax probabilities are recomputed per tile from q, k and lse.
void attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                        const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv, float scale = 0.0f,
                        const AttentionTiles& tiles = {}, const AttentionWindow& window = {},
                        AttentionAccumulate accumulate = {});

// The work of the tiles attention_forward and attention_backward run, per
// query head, summed over the B sequences: the score elements of their
// products (query rows × keys, a tile masked in part counting whole), and the
// same without the window's documents (causal). kept() is the share of the
// causal tiles' work block-causal attention does, a forward tile weighed as
// its two products and a backward tile as its five.
struct AttentionTileCount {
  double forward = 0, backward = 0;
  double causal_forward = 0, causal_backward = 0;
  double kept() const {
    const double all = 2.0 * causal_forward + 5.0 * causal_backward;
    return all > 0 ? (2.0 * forward + 5.0 * backward) / all : 1.0;
  }
};
AttentionTileCount attention_tile_count(int64_t B, int64_t Tq, int64_t Tk, const AttentionTiles& tiles = {},
                                        const AttentionWindow& window = {});

// The attention of the same queries over disjoint sets of keys, each part with
// its log-sum-exp, combines into the attention over their union (context
// parallelism's ring: a rank's queries meet the keys one rank's block at a time):
//   lse = log(e^lse_acc + e^lse_part)
//   acc = e^(lse_acc − lse) · acc + e^(lse_part − lse) · part
// acc (B, T, H, D) f32 and lse_acc (B, H, T) f32 are updated in place; part
// (B, T, H, D) is f32 or bf16, lse_part (B, H, T) f32. A row whose lse_acc is
// −∞ (no keys yet) takes part as it is, whatever acc held; a part whose
// lse_part is −∞ changes nothing.
void attention_merge(const Tensor& part, const Tensor& lse_part, Tensor& acc, Tensor& lse_acc);

}  // namespace anvil
