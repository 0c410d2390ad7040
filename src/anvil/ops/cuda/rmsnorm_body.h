// RMSNorm's block programs (kernel_body.h), the CUDA twins of ops/rmsnorm.h:
// y = x·r·w with r = 1/sqrt(mean(x²) + eps) per row (saved as rstd), and
//   dx_j = r·dy_j·w_j − (r³/D)·dot·x_j,  dot = Σ_k dy_k·w_k·x_k
//   dw_j += Σ_rows dy_j·x_j·r.
// f32 arithmetic, f32 or bf16 storage. A row's sums (Σx², dot) are each a
// per-thread partial then block_sum, so the host run gives the device's bits.
//
// dw is a sum over rows, made deterministic without atomics: the rows are cut
// into splits of kRmsnormRowsPerSplit (a function of M only), the block that
// owns a split walks its rows in order and keeps that split's dw partial in
// its own row of an (splits, D) f32 scratch, and a second kernel adds each
// column's partials in split order to dw. No order depends on the grid, so
// dw's bits depend only on the values and M.
//
// Every product the formulas round is written with mul_rn/fma_rn, so neither
// compiler picks a contraction of its own.
#pragma once
#include <cstdint>

#include "anvil/ops/cuda/kernel_body.h"

namespace anvil::kernel {

constexpr unsigned kRmsnormThreads = 256;
// Rows per dw split: enough blocks for a GPU at training's M (8192 rows make
// 512), a scratch of a quarter of x's f32 size at most.
constexpr int64_t kRmsnormRowsPerSplit = 16;
constexpr unsigned kRmsnormMaxBlocks = 65535;

ANVIL_HD inline int64_t rmsnorm_dw_splits(int64_t M) { return (M + kRmsnormRowsPerSplit - 1) / kRmsnormRowsPerSplit; }

// One block per row (per split for the backward), grid-stride past the cap.
inline LaunchShape rmsnorm_forward_launch_shape(int64_t M) {
  return {{blocks_for(M, 1, kRmsnormMaxBlocks), 1}, {kRmsnormThreads, 1}};
}
inline LaunchShape rmsnorm_backward_launch_shape(int64_t M) {
  return {{blocks_for(rmsnorm_dw_splits(M), 1, kRmsnormMaxBlocks), 1}, {kRmsnormThreads, 1}};
}
inline LaunchShape rmsnorm_dw_launch_shape(int64_t D) { return {{blocks_for(D, kRmsnormThreads), 1}, {kRmsnormThreads, 1}}; }

// The CPU op's rstd_of, with its roundings: 1 / sqrt(Σx² / D + eps).
ANVIL_HD inline float rmsnorm_rstd(float sum_squares, int64_t D, float eps) {
  return div_rn(1.0f, sqrt_rn(div_rn(sum_squares, static_cast<float>(D)) + eps));
}

// x, y (M, D); w (D); rstd (M) or null. y may be x.
template <class Block, class T>
ANVIL_HD void rmsnorm_forward_program(Block& block, const T* x, const T* w, float eps, T* y, float* rstd, int64_t M,
                                      int64_t D) {
  for (int64_t m = block.index(); m < M; m += block.count()) {
    const T* xr = x + m * D;
    T* yr = y + m * D;
    const float sum_squares = block.template sum<float>([&](const ThreadPos& p) {
      float acc = 0;
      for (int64_t j = p.thread_in_block(); j < D; j += p.threads_per_block()) {
        const float v = load_f32(xr, j);
        acc = fma_rn(v, v, acc);
      }
      return acc;
    });
    const float r = rmsnorm_rstd(sum_squares, D, eps);
    block.each([&](const ThreadPos& p) {
      if (rstd && p.thread_in_block() == 0) rstd[m] = r;
      // (x·r)·w, the CPU op's order.
      for (int64_t j = p.thread_in_block(); j < D; j += p.threads_per_block())
        store_f32(yr, j, mul_rn(mul_rn(load_f32(xr, j), r), load_f32(w, j)));
    });
  }
}

// dy, x, dx (M, D); w (D); rstd (M) from the forward; dw_partials (splits, D)
// f32, every row of it written. dx may be dy (each thread reads a column's dy
// before writing its dx).
template <class Block, class T>
ANVIL_HD void rmsnorm_backward_program(Block& block, const T* dy, const T* x, const T* w, const float* rstd, T* dx,
                                       float* dw_partials, int64_t M, int64_t D, bool accumulate_dx) {
  const int64_t splits = rmsnorm_dw_splits(M);
  for (int64_t s = block.index(); s < splits; s += block.count()) {
    float* pdw = dw_partials + s * D;
    const int64_t first = s * kRmsnormRowsPerSplit;
    const int64_t end = first + kRmsnormRowsPerSplit < M ? first + kRmsnormRowsPerSplit : M;
    for (int64_t m = first; m < end; ++m) {
      const T *dyr = dy + m * D, *xr = x + m * D;
      T* dxr = dx + m * D;
      const float r = rstd[m];
      const float dot = block.template sum<float>([&](const ThreadPos& p) {
        float acc = 0;
        for (int64_t j = p.thread_in_block(); j < D; j += p.threads_per_block())
          acc = fma_rn(mul_rn(load_f32(dyr, j), load_f32(w, j)), load_f32(xr, j), acc);
        return acc;
      });
      // r³·dot / D in the CPU op's order.
      const float c = div_rn(mul_rn(mul_rn(mul_rn(r, r), r), dot), static_cast<float>(D));
      block.each([&](const ThreadPos& p) {
        for (int64_t j = p.thread_in_block(); j < D; j += p.threads_per_block()) {
          const float dyj = load_f32(dyr, j), xj = load_f32(xr, j);
          float g = fma_rn(-c, xj, mul_rn(mul_rn(dyj, load_f32(w, j)), r));
          if (accumulate_dx) g = g + load_f32(dxr, j);
          store_f32(dxr, j, g);
          // The split's first row starts the partial (the scratch needs no clearing).
          const float dyx = mul_rn(dyj, xj);
          pdw[j] = m == first ? mul_rn(dyx, r) : fma_rn(dyx, r, pdw[j]);
        }
      });
    }
  }
}

// dw_j ← dw_j + Σ_s dw_partials[s][j], the splits in order from a zero sum
// (the CPU op's order over its chunks); one rounding into a bf16 dw.
template <class G>
ANVIL_HD void rmsnorm_dw_body(const ThreadPos& pos, const float* dw_partials, int64_t splits, int64_t D, G* dw) {
  for (int64_t j = pos.global_x(); j < D; j += pos.grid_stride_x()) {
    float sum = 0;
    for (int64_t s = 0; s < splits; ++s) sum = sum + dw_partials[s * D + j];
    store_f32(dw, j, load_f32(dw, j) + sum);
  }
}

}  // namespace anvil::kernel
