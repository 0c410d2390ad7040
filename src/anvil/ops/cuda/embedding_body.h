// The token embedding's bodies (kernel_body.h), the CUDA twins of
// ops/embedding.h's embedding_forward and embedding_backward.
//
// Forward: a 2-D grid, blockIdx.y over tokens and x over the row's columns,
// both grid-stride; each element is copied (same storage type) or converted
// once (f32 ↔ bf16, rounding to nearest even), as the CPU op does.
//
// Backward, deterministic without atomics: each thread owns one column of
// dtable and walks all M tokens in order, adding dout[m][j] into row tokens[m].
// No two threads write the same element and repeated ids add up in token
// order, so the sums are the CPU op's, bit for bit (it splits its threads over
// columns for the same reasons). The price is parallelism: D threads in all
// (e.g. 4096), each walking M tokens. A sorted index (one block per distinct
// id over its positions in token order) would give M-wide parallelism and the
// same sums, at the cost of a device sort per step; it is the next step if the
// backward shows in a profile.
//
// Ids are checked on the host, where the batch is before its upload (the CPU
// op's check): the kernels cannot throw. So that a bad id cannot touch memory
// outside the table all the same, the forward writes a zero row for it and the
// backward skips it.
#pragma once
#include <cstdint>

#include "anvil/ops/cuda/kernel_body.h"

namespace anvil::kernel {

constexpr unsigned kEmbeddingThreads = 256;
constexpr unsigned kEmbeddingBackwardThreads = 128;
constexpr unsigned kMaxGridY = 65535;

inline LaunchShape embedding_forward_launch_shape(int64_t tokens, int64_t dim) {
  const int64_t rows = tokens < 1 ? 1 : tokens < kMaxGridY ? tokens : kMaxGridY;
  return {{blocks_for(dim, kEmbeddingThreads), static_cast<unsigned>(rows)}, {kEmbeddingThreads, 1}};
}
inline LaunchShape embedding_backward_launch_shape(int64_t dim) {
  return {{blocks_for(dim, kEmbeddingBackwardThreads), 1}, {kEmbeddingBackwardThreads, 1}};
}

// dst[j] = src[i]: a copy when the storage types agree (bits kept, NaN payloads
// included, as the CPU op's memcpy), a rounding conversion when they differ.
template <class S, class Dst>
ANVIL_HD void convert_element(const S* src, int64_t i, Dst* dst, int64_t j) {
  store_f32(dst, j, load_f32(src, i));
}
ANVIL_HD inline void convert_element(const float* src, int64_t i, float* dst, int64_t j) { dst[j] = src[i]; }
ANVIL_HD inline void convert_element(const uint16_t* src, int64_t i, uint16_t* dst, int64_t j) { dst[j] = src[i]; }

template <class S, class Dst>
ANVIL_HD void embedding_forward_body(const ThreadPos& pos, const int32_t* tokens, int64_t M, const S* table, int64_t V,
                                     int64_t D, Dst* out) {
  const int64_t row_stride = pos.grid_dim.y;
  for (int64_t m = pos.block.y; m < M; m += row_stride) {
    const int64_t id = tokens[m];
    for (int64_t j = pos.global_x(); j < D; j += pos.grid_stride_x()) {
      if (id >= 0 && id < V)
        convert_element(table, id * D + j, out, m * D + j);
      else
        store_f32(out, m * D + j, 0.0f);
    }
  }
}

template <class S, class G>
ANVIL_HD void embedding_backward_body(const ThreadPos& pos, const S* dout, const int32_t* tokens, int64_t M, int64_t V,
                                      int64_t D, G* dtable) {
  for (int64_t j = pos.global_x(); j < D; j += pos.grid_stride_x())
    for (int64_t m = 0; m < M; ++m) {
      const int64_t id = tokens[m];
      if (id < 0 || id >= V) continue;
      store_f32(dtable, id * D + j, load_f32(dtable, id * D + j) + load_f32(dout, m * D + j));
    }
}

}  // namespace anvil::kernel
