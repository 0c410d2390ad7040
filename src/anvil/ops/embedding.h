// Token embedding: a row gather forward, a row scatter-add backward.
#pragma once
#include "anvil/core/tensor.h"

namespace anvil {

// tokens (M) i32, any shape (e.g. (B, T)); M = tokens.numel()
// table  (V, D) f32 or bf16
// out    (M, D) f32 or bf16 (any shape with M·D elements and last dim D, e.g.
//        (B, T, D)): written. Its dtype may differ from the table's (an f32
//        master table gathered into bf16 activations): each element is
//        converted once, rounding to nearest even.
// A token id outside [0, V) throws anvil::Error naming the position, the id
// and V; nothing is written then.
void embedding_forward(const Tensor& tokens, const Tensor& table, Tensor& out);

// Throws anvil::Error naming the first id of `tokens` (host i32) outside
// [0, V), its position and V; `what` names the caller. The ops' own check,
// also made on the host before a batch is copied to a GPU, whose kernels
// cannot throw.
void check_token_ids(const Tensor& tokens, int64_t V, const char* what);

// dout   (M, D) f32 or bf16, gradient of out
// tokens (M) i32, as in the forward (checked again: a bad id would write
//        outside dtable)
// dtable (V, D) f32 or bf16: ACCUMULATED, dtable[tokens[m]] += dout[m]. May
//        be f32 while dout is bf16. Repeated ids add up, in token order.
void embedding_backward(const Tensor& dout, const Tensor& tokens, Tensor& dtable);

// Vocabulary-parallel embedding (tensor parallelism): `table` (V_t, D) holds
// rows [vocab_begin, vocab_begin + V_t) of a (vocab_size, D) table; rows at or
// past vocab_size are padding and never read. Ids are checked against
// [0, vocab_size). Forward: a token in the shard's range gets its row, any
// other a zero row (summing the shards' outputs over the ranks gives the
// whole table's lookup, exactly). Backward: only tokens in the range add into
// dtable (ACCUMULATED), in token order.
void embedding_forward_shard(const Tensor& tokens, const Tensor& table, int64_t vocab_begin, int64_t vocab_size,
                             Tensor& out);
void embedding_backward_shard(const Tensor& dout, const Tensor& tokens, int64_t vocab_begin, int64_t vocab_size,
                              Tensor& dtable);

}  // namespace anvil
