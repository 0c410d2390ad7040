// The experts' products of a mixture-of-experts layer: after the dispatch
// (ops/moe_dispatch.h) expert e's tokens are the contiguous rows
// [offsets[e], offsets[e + 1]) of x, and each run of rows meets that expert's
// own weight. A grouped linear layer:
//
//   forward          y[rows of e]  = x[rows of e] · w[e]ᵀ       x (R, K), w (E, N, K), y (R, N)
//   backward input   dx[rows of e] = dy[rows of e] · w[e]       dx (R, K)
//   backward weight  dw[e]        += dy[rows of e]ᵀ · x[rows of e]   dw (E, N, K), f32 or x's dtype
//
// Dropless routing makes the row counts data-dependent, so one call runs all
// experts: the work is cut into tasks (an expert's rows in blocks of
// kGroupedRowBlock for the forward and input gradient, whole experts for the
// weight gradient, whose tasks each own one dw[e]) that the threads take from
// a shared counter, every product single-threaded inside the one parallel
// region. Whole blocks run at their fixed shape; an expert's last, shorter
// block leaves its row count to the call (RuntimeDim, ops/matmul.h), so each
// product keeps two oneDNN kernels whatever the routing, where one per row
// count seen would grow, outside the allocator, for as long as learned
// routing makes new counts. An expert with
// no rows costs nothing; one with every row is one run like any other.
//
// Tensors f32 or bf16 (x, w, y, dy, dx share one dtype), sums in f32; the
// results do not depend on the thread count (each output element is one
// product's, or, for dw, one expert's blocks in row order).
#pragma once
#include <cstdint>
#include <vector>

#include "anvil/core/tensor.h"

namespace anvil {

// Rows per block of the forward's and input gradient's products; the weight
// gradient sums an expert's rows in blocks of kGroupedWeightBlock.
inline constexpr int64_t kGroupedRowBlock = 128;
inline constexpr int64_t kGroupedWeightBlock = 512;

// offsets: E + 1 row offsets, ascending from 0 to R (ExpertRoutes::offsets).
void grouped_linear_forward(const Tensor& x, const Tensor& w, const std::vector<int64_t>& offsets, Tensor& y);
// dx overwritten, or added to when accumulate (an input feeding two experts' products).
void grouped_linear_backward_input(const Tensor& dy, const Tensor& w, const std::vector<int64_t>& offsets,
                                   Tensor& dx, bool accumulate = false);
// dw accumulated (dw[e] += ...).
void grouped_linear_backward_weight(const Tensor& dy, const Tensor& x, const std::vector<int64_t>& offsets,
                                    Tensor& dw);

}  // namespace anvil
