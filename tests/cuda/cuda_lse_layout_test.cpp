// The lse between Anvil's (B, H, T) and the token-major (B, T, H) statistics
// of cuDNN's ragged SDPA (ops/cuda/lse_layout_body.h, lse_layout.h).
//
// On any host: the body, run over its kernel's launch grid and over grids too
// small for one pass (so its grid-stride loop comes round again), writes
// every destination element (the destination starts as NaN) with exactly the
// bits a plain loop's transpose puts there, for odd sizes of each dim (one
// head, one token, sizes off the block's 256 threads); and the inverse
// direction gives back the source bit for bit, −0 and −∞ (the lse of a row
// that sees no key) included. With a GPU (skipped without one): the kernel
// gives the host run's bits in both directions.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "anvil/ops/cuda/lse_layout.h"
#include "anvil/ops/cuda/lse_layout_body.h"
#include "cuda_test_util.h"
#include "kernel_check_util.h"

namespace {

using namespace anvil;
using namespace anvil::testing;
using anvil::kernel::LaunchShape;
using anvil::kernel::ThreadPos;

struct LseShape {
  int64_t B, H, T;
  int64_t n() const { return B * H * T; }
  std::string str() const {
    return "B=" + std::to_string(B) + " H=" + std::to_string(H) + " T=" + std::to_string(T);
  }
};

// Heads and tokens each 1 somewhere, 37 (not a multiple of anything the body
// divides by), 260 (past one block's threads).
const LseShape kShapes[] = {{2, 3, 37}, {1, 5, 1}, {3, 1, 260}};

// lse values (B, H, T), with the values whose bits a copy must keep and
// arithmetic could change: −0 and −∞.
std::vector<float> lse_values(const LseShape& s, uint32_t seed) {
  std::vector<float> v = random_storage<float>(s.n(), 4.0f, seed);
  v.front() = -0.0f;
  v.back() = -INFINITY;
  return v;
}

// The transpose as a plain loop: dst (B, T, H) from src (B, H, T).
std::vector<float> token_major_by_loop(const std::vector<float>& src, const LseShape& s) {
  std::vector<float> dst(static_cast<size_t>(s.n()));
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.H; ++h)
      for (int64_t t = 0; t < s.T; ++t) dst[(b * s.T + t) * s.H + h] = src[(b * s.H + h) * s.T + t];
  return dst;
}

// The body over grid `g`, into a destination of NaN (so an element it skips shows).
std::vector<float> transposed_on_host(const LaunchShape& g, const std::vector<float>& src, const LseShape& s,
                                      bool to_token_major) {
  std::vector<float> dst(src.size(), NAN);
  kernel::for_each_thread_on_host(g, [&](const ThreadPos& p) {
    kernel::lse_transpose_body(p, src.data(), dst.data(), s.B, s.H, s.T, to_token_major);
  });
  return dst;
}

// The kernel's grid, 3 blocks of its 256 threads, and 3 blocks of 32: fewer
// threads than elements for the larger shapes, so threads take a second turn.
std::vector<LaunchShape> grids_for(const LseShape& s) {
  return {kernel::lse_transpose_launch_shape(s.n()), LaunchShape{{3, 1}, {kernel::kLseTransposeThreads, 1}},
          LaunchShape{{3, 1}, {32, 1}}};
}

TEST(CudaLseLayoutBody, TransposesExactlyAndBackOverAnyGrid) {
  uint32_t seed = 1;
  for (const LseShape& s : kShapes) {
    SCOPED_TRACE(s.str());
    const std::vector<float> src = lse_values(s, seed++);
    const std::vector<float> want = token_major_by_loop(src, s);
    for (const LaunchShape& g : grids_for(s)) {
      const std::string what = s.str() + ", " + std::to_string(g.grid.x) + " blocks of " +
                               std::to_string(g.block.x);
      const std::vector<float> token_major = transposed_on_host(g, src, s, true);
      expect_same_bits(what + ": (B, T, H) vs the loop's", token_major, want);
      expect_same_bits(what + ": back to (B, H, T) vs the source", transposed_on_host(g, token_major, s, false), src);
    }
  }
}

TEST(CudaLseLayoutKernel, GivesTheHostRunsBits) {
  SKIP_WITHOUT_GPU();
  uint32_t seed = 1;
  for (const LseShape& s : kShapes) {
    SCOPED_TRACE(s.str());
    const std::vector<float> src = lse_values(s, seed++);
    const LaunchShape g = kernel::lse_transpose_launch_shape(s.n());
    const std::vector<float> host = transposed_on_host(g, src, s, true);
    const std::vector<float> nans(src.size(), NAN);
    const DeviceArray<float> src_d(src), token_major_d(nans), back_d(nans);
    lse_transpose_cuda(src_d.get(), token_major_d.get(), s.B, s.H, s.T, true, nullptr);
    lse_transpose_cuda(token_major_d.get(), back_d.get(), s.B, s.H, s.T, false, nullptr);
    expect_same_bits(s.str() + ": GPU vs host (B, T, H)", token_major_d.download(), host);
    expect_same_bits(s.str() + ": GPU vs host back to (B, H, T)", back_d.download(),
                     transposed_on_host(g, host, s, false));
  }
}

}  // namespace
