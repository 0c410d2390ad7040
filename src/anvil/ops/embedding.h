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

// dout   (M, D) f32 or bf16, gradient of out
// tokens (M) i32, as in the forward (checked again: a bad id would write
//        outside dtable)
// dtable (V, D) f32 or bf16: ACCUMULATED, dtable[tokens[m]] += dout[m]. May
//        be f32 while dout is bf16. Repeated ids add up, in token order.
void embedding_backward(const Tensor& dout, const Tensor& tokens, Tensor& dtable);

}  // namespace anvil
