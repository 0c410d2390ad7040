// Dropless dispatch of tokens to experts and the weighted combine of their
// outputs: the two ends of a mixture-of-experts layer around its experts'
// products. Every (token, slot) route of the router (ops/moe_router.h) is one
// row; sorting the M·k routes by expert, stably (token order within an
// expert), makes each expert's tokens one contiguous run of rows, the operand
// of its (grouped) product. No capacity, so no token is dropped, however
// unbalanced the routing.
//
//   dispatch   xe[r] = x[token of route order[r]]                 (M, D) → (M·k, D)
//   combine    y[t]  = Σ_j weights[t, j] · ye[row of route (t, j)] (M·k, D) → (M, D)
//
// and their backwards (the dispatch's adds each token's k rows; the combine's
// gives each row its weighted gradient and each weight its dot product).
// Tensors f32 or bf16 (sums in f32); weights f32.
#pragma once
#include <cstdint>
#include <vector>

#include "anvil/core/tensor.h"

namespace anvil {

struct ExpertRoutes {
  int64_t tokens = 0, top_k = 0;
  std::vector<int64_t> offsets;  // E + 1: expert e's rows are [offsets[e], offsets[e + 1])
  Tensor order;                  // (M·k) i32: the route (t·k + j) row r holds
  Tensor row_of;                 // (M·k) i32: the row route t·k + j sits in
  int64_t rows(int64_t e) const { return offsets[static_cast<size_t>(e + 1)] - offsets[static_cast<size_t>(e)]; }
};

// The routes of experts (M, k) i32 over E experts, sorted by expert. A dry
// run has no expert choices: its rows per expert are dry_run_offsets (E + 1)
// where given (the forced-balance rule's, ops/moe_router.h's
// balanced_route_offsets, which are exact), else the round-robin spread of
// balanced_offsets (learned routing's assumption).
ExpertRoutes sort_routes(const Tensor& experts, int64_t num_experts, const std::vector<int64_t>& dry_run_offsets = {});

// Rows per expert when `routes` routes go round-robin over E experts: the
// first routes mod E experts get one more than the rest.
std::vector<int64_t> balanced_offsets(int64_t routes, int64_t num_experts);

void dispatch_forward(const Tensor& x, const ExpertRoutes& routes, Tensor& xe);
// dx (M, D) = Σ over each token's k rows of dxe (overwritten).
void dispatch_backward(const Tensor& dxe, const ExpertRoutes& routes, Tensor& dx);

// With a residual (M, D) of y's dtype: y = residual + the combine.
// Expert parallelism's reordering of the rows a rank received, which come
// source rank by source rank, into expert-major order (each local expert's
// rows from every source together), and back:
//   gather_rows   dst[i] = src[index[i]]
//   scatter_rows  dst[index[i]] = src[i]
// index (n) i32, a permutation of the n rows; src and dst (n, D), one dtype.
void gather_rows(const Tensor& src, const Tensor& index, Tensor& dst);
void scatter_rows(const Tensor& src, const Tensor& index, Tensor& dst);

void combine_forward(const Tensor& ye, const Tensor& weights, const ExpertRoutes& routes, Tensor& y,
                     const Tensor& residual = {});
// dye (M·k, D) = weight · dy[token]; dweights (M, k) f32 = dy[token] · ye[row]; both overwritten.
void combine_backward(const Tensor& dy, const Tensor& ye, const Tensor& weights, const ExpertRoutes& routes,
                      Tensor& dye, Tensor& dweights);

}  // namespace anvil
