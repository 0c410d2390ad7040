// What Anvil's CUDA kernels are written with, so that their bodies also run on
// the host: a kernel is a thin __global__ wrapper around an ANVIL_HD body that
// takes its grid position as an argument (ThreadPos) instead of reading
// blockIdx/threadIdx. The host runners below call a body for every thread of
// the kernel's grid, so a machine without a GPU runs the very code the GPU
// runs, over the very same grid, and the tests compare it with the CPU ops.
//
// Kernels that reduce over a block are written in phases: each thread computes
// a partial, block_sum adds the partials, each thread uses the total. The host
// runs such a kernel phase by phase (block_reduction_on_host), with a
// block_sum that adds in the device's exact order, so host and device give the
// same bits for the same block size.
//
// Plain C++ for g++; the device parts are compiled only by nvcc.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#ifndef __CUDACC__
#include <vector>
#endif

#ifdef __CUDACC__
#define ANVIL_HD __host__ __device__
#else
#define ANVIL_HD
#endif

namespace anvil::kernel {

// A 1-D or 2-D grid of 1-D or 2-D blocks (z is always 1).
struct Dim2 {
  unsigned x = 1, y = 1;
};

struct LaunchShape {
  Dim2 grid, block;
};

// Where a thread sits in its grid: blockIdx, threadIdx, gridDim, blockDim.
struct ThreadPos {
  Dim2 block, thread, grid_dim, block_dim;

  ANVIL_HD int64_t global_x() const { return static_cast<int64_t>(block.x) * block_dim.x + thread.x; }
  ANVIL_HD int64_t grid_stride_x() const { return static_cast<int64_t>(grid_dim.x) * block_dim.x; }
  // The thread's rank in its block, as the hardware numbers lanes and warps.
  ANVIL_HD unsigned thread_in_block() const { return thread.y * block_dim.x + thread.x; }
  ANVIL_HD unsigned threads_per_block() const { return block_dim.x * block_dim.y; }
};

constexpr unsigned kWarpSize = 32;

// Blocks for n elements at `threads` per block, capped so a grid-stride loop
// covers the rest; a cap keeps the grid within gridDim.x's limit and makes a
// huge buffer cost no more launch overhead than a big one.
inline unsigned blocks_for(int64_t n, unsigned threads, unsigned max_blocks = 65536) {
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(blocks < 1 ? 1 : blocks < max_blocks ? blocks : max_blocks);
}

// Round-to-nearest arithmetic for bodies whose host and device runs must
// agree bit for bit. nvcc contracts a*b + c into one FMA by default (and g++
// does on the host too, -ffp-contract=fast being GNU C++'s default), each
// compiler where it sees fit; the _rn intrinsics are never contracted. Such a
// body says where it means a fused multiply-add (fma_rn) and feeds no other
// product into an addition, so neither compiler has a choice to make.
ANVIL_HD inline float fma_rn(float a, float b, float c) {
#ifdef __CUDA_ARCH__
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
ANVIL_HD inline float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
ANVIL_HD inline float div_rn(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
ANVIL_HD inline float sqrt_rn(float a) {
#ifdef __CUDA_ARCH__
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

// e^x: CUDA's expf on the device (at most 2 ulp off, per the CUDA C
// Programming Guide's accuracy tables; not the __expf intrinsic), the C
// library's on the host.
ANVIL_HD inline float exp_f32(float x) {
#ifdef __CUDA_ARCH__
  return expf(x);
#else
  return std::exp(x);
#endif
}

ANVIL_HD inline uint32_t bits_of(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}
ANVIL_HD inline float float_of(uint32_t u) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// bf16 conversions, the same integer arithmetic as bf16::from_float and
// bf16::to_float (core/dtype.h), so the device writes the CPU's bits, NaN
// payloads included (the hardware's cvt.rn.bf16.f32 makes every NaN 0x7fff).
ANVIL_HD inline uint16_t bf16_from_f32(float f) {
  uint32_t u = bits_of(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
ANVIL_HD inline float f32_from_bf16(uint16_t b) { return float_of(static_cast<uint32_t>(b) << 16); }

// Storage-type helpers, so one body serves f32 and bf16 (uint16_t bits) buffers.
ANVIL_HD inline float load_f32(const float* p, int64_t i) { return p[i]; }
ANVIL_HD inline float load_f32(const uint16_t* p, int64_t i) { return f32_from_bf16(p[i]); }
ANVIL_HD inline void store_f32(float* p, int64_t i, float x) { p[i] = x; }
ANVIL_HD inline void store_f32(uint16_t* p, int64_t i, float x) { p[i] = bf16_from_f32(x); }

// The order block_sum adds in, one warp's worth: the shuffle-down tree
// (offsets 16, 8, 4, 2, 1), after which lane 0 holds the sum. The block sum is
// this tree over each warp's threads, then the same tree over the warps' sums
// (padded with zeros to a warp).
template <class T>
ANVIL_HD inline T warp_tree_on_host(T* lanes) {
  for (unsigned offset = kWarpSize / 2; offset > 0; offset /= 2)
    for (unsigned lane = 0; lane < offset; ++lane) lanes[lane] = lanes[lane] + lanes[lane + offset];
  return lanes[0];
}

// The sum of a block's per-thread partials (partials[thread_in_block()]) in
// block_sum's order: bit for bit what the device returns for the same values.
// `threads` is a multiple of the warp size, at most 1024.
template <class T>
T block_sum_on_host(const T* partials, unsigned threads) {
  T warp_sums[kWarpSize] = {};
  for (unsigned w = 0; w < threads / kWarpSize; ++w) {
    T lanes[kWarpSize];
    for (unsigned lane = 0; lane < kWarpSize; ++lane) lanes[lane] = partials[w * kWarpSize + lane];
    warp_sums[w] = warp_tree_on_host(lanes);
  }
  return warp_tree_on_host(warp_sums);
}

#ifdef __CUDACC__

template <class T>
__device__ inline T warp_sum(T v) {
  for (unsigned offset = kWarpSize / 2; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
  return v;
}

// The sum of v over the calling block, returned to every thread; every thread
// of the block must call it. The block's size is a multiple of the warp size.
template <class T>
__device__ inline T block_sum(T v) {
  __shared__ T warp_sums[kWarpSize];
  const unsigned t = threadIdx.y * blockDim.x + threadIdx.x;
  const unsigned lane = t % kWarpSize, warp = t / kWarpSize;
  v = warp_sum(v);
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const unsigned warps = blockDim.x * blockDim.y / kWarpSize;
    T s = warp_sum(lane < warps ? warp_sums[lane] : T(0));
    if (lane == 0) warp_sums[0] = s;
  }
  __syncthreads();
  const T total = warp_sums[0];
  __syncthreads();  // everyone has read it before a later call overwrites warp_sums
  return total;
}

__device__ inline ThreadPos this_thread() {
  return ThreadPos{{blockIdx.x, blockIdx.y}, {threadIdx.x, threadIdx.y}, {gridDim.x, gridDim.y}, {blockDim.x, blockDim.y}};
}

// A phased kernel's device run: total = block_sum(partial(pos)), then finish(pos, total).
template <class T, class Partial, class Finish>
__device__ inline void block_reduction(Partial partial, Finish finish) {
  const ThreadPos pos = this_thread();
  const T total = block_sum<T>(partial(pos));
  finish(pos, total);
}

#else

// body(pos) for every thread of every block of the grid, block by block.
template <class Body>
void for_each_thread_on_host(const LaunchShape& s, Body&& body) {
  ThreadPos pos{{}, {}, s.grid, s.block};
  for (pos.block.y = 0; pos.block.y < s.grid.y; ++pos.block.y)
    for (pos.block.x = 0; pos.block.x < s.grid.x; ++pos.block.x)
      for (pos.thread.y = 0; pos.thread.y < s.block.y; ++pos.thread.y)
        for (pos.thread.x = 0; pos.thread.x < s.block.x; ++pos.thread.x) body(pos);
}

// A phased kernel's host run, block by block: every thread's partial, then the
// block's sum in block_sum's order, then every thread's finish(pos, total).
template <class T, class Partial, class Finish>
void block_reduction_on_host(const LaunchShape& s, Partial&& partial, Finish&& finish) {
  const unsigned threads = s.block.x * s.block.y;
  std::vector<T> partials(threads);
  ThreadPos pos{{}, {}, s.grid, s.block};
  auto for_threads = [&](auto&& fn) {
    for (pos.thread.y = 0; pos.thread.y < s.block.y; ++pos.thread.y)
      for (pos.thread.x = 0; pos.thread.x < s.block.x; ++pos.thread.x) fn();
  };
  for (pos.block.y = 0; pos.block.y < s.grid.y; ++pos.block.y)
    for (pos.block.x = 0; pos.block.x < s.grid.x; ++pos.block.x) {
      for_threads([&] { partials[pos.thread_in_block()] = partial(pos); });
      const T total = block_sum_on_host(partials.data(), threads);
      for_threads([&] { finish(pos, total); });
    }
}

#endif

}  // namespace anvil::kernel
