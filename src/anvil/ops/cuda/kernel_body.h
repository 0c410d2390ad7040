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
// A kernel that makes several reductions per block, or walks several rows per
// block, is written as a block program (DeviceBlock, HostBlock below): one function,
// templated on the block it runs on, that alternates per-thread phases with
// block-wide sums and maxima; the device runs it with DeviceBlock, the host
// with HostBlock, thread by thread between the reductions.
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

// ln x: CUDA's logf on the device (at most 1 ulp off, per the same tables),
// the C library's on the host.
ANVIL_HD inline float log_f32(float x) {
#ifdef __CUDA_ARCH__
  return logf(x);
#else
  return std::log(x);
#endif
}

// The larger of a and b by one comparison, the same on the host and the
// device (fmaxf may pick either zero of ±0, and the two libraries need not
// pick alike). A NaN b is passed over; a NaN a is kept.
ANVIL_HD inline float max_f32(float a, float b) { return b > a ? b : a; }

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
// block_max combines in the same tree with max_f32, its padding −∞.
template <class T, class Combine>
ANVIL_HD inline T warp_tree_on_host(T* lanes, Combine combine) {
  for (unsigned offset = kWarpSize / 2; offset > 0; offset /= 2)
    for (unsigned lane = 0; lane < offset; ++lane) lanes[lane] = combine(lanes[lane], lanes[lane + offset]);
  return lanes[0];
}
template <class T>
ANVIL_HD inline T warp_tree_on_host(T* lanes) {
  return warp_tree_on_host(lanes, [](T a, T b) { return a + b; });
}

template <class T, class Combine>
T block_tree_on_host(const T* partials, unsigned threads, T padding, Combine combine) {
  T warp_totals[kWarpSize];
  for (T& v : warp_totals) v = padding;
  for (unsigned w = 0; w < threads / kWarpSize; ++w) {
    T lanes[kWarpSize];
    for (unsigned lane = 0; lane < kWarpSize; ++lane) lanes[lane] = partials[w * kWarpSize + lane];
    warp_totals[w] = warp_tree_on_host(lanes, combine);
  }
  return warp_tree_on_host(warp_totals, combine);
}

// The sum of a block's per-thread partials (partials[thread_in_block()]) in
// block_sum's order: bit for bit what the device returns for the same values.
// `threads` is a multiple of the warp size, at most 1024.
template <class T>
T block_sum_on_host(const T* partials, unsigned threads) {
  return block_tree_on_host(partials, threads, T(0), [](T a, T b) { return a + b; });
}

// The maximum of a block's partials in block_max's order (max_f32), its bits.
inline float block_max_on_host(const float* partials, unsigned threads) {
  return block_tree_on_host(partials, threads, -INFINITY, max_f32);
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

// The maximum (max_f32) of v over the calling block, returned to every
// thread; as block_sum, with −∞ for the missing warps.
__device__ inline float block_max(float v) {
  __shared__ float warp_maxima[kWarpSize];
  const unsigned t = threadIdx.y * blockDim.x + threadIdx.x;
  const unsigned lane = t % kWarpSize, warp = t / kWarpSize;
  for (unsigned offset = kWarpSize / 2; offset > 0; offset /= 2) v = max_f32(v, __shfl_down_sync(0xffffffffu, v, offset));
  if (lane == 0) warp_maxima[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const unsigned warps = blockDim.x * blockDim.y / kWarpSize;
    float m = lane < warps ? warp_maxima[lane] : -INFINITY;
    for (unsigned offset = kWarpSize / 2; offset > 0; offset /= 2) m = max_f32(m, __shfl_down_sync(0xffffffffu, m, offset));
    if (lane == 0) warp_maxima[0] = m;
  }
  __syncthreads();
  const float total = warp_maxima[0];
  __syncthreads();
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

// The block a block program runs on, on the device: each(f) is f(this
// thread), sum and max reduce f(this thread) over the block. Every thread of
// the block calls each of them, in the same order.
struct DeviceBlock {
  __device__ unsigned index() const { return blockIdx.x; }
  __device__ unsigned count() const { return gridDim.x; }
  template <class F>
  __device__ void each(F&& f) const {
    f(this_thread());
  }
  template <class T, class F>
  __device__ T sum(F&& f) const {
    return block_sum<T>(f(this_thread()));
  }
  template <class F>
  __device__ float max(F&& f) const {
    return block_max(f(this_thread()));
  }
};

#else

// A block program's block on the host: each(f) runs f for every thread of
// the block, sum and max collect every thread's f and reduce them in the
// device's order. A program keeps nothing but block-wide values (row indices,
// reduction results) outside the functions it hands over: on the host those
// functions' threads run one after another, so per-thread state between the
// phases lives in memory, as it does between the device's phases anyway for
// anything a thread does not itself hold.
class HostBlock {
 public:
  HostBlock(const LaunchShape& s, unsigned block) : pos_{{block, 0}, {}, s.grid, s.block} {}
  unsigned index() const { return pos_.block.x; }
  unsigned count() const { return pos_.grid_dim.x; }
  template <class F>
  void each(F&& f) {
    for_threads([&](const ThreadPos& p) { f(p); });
  }
  template <class T, class F>
  T sum(F&& f) {
    std::vector<T> partials(threads());
    for_threads([&](const ThreadPos& p) { partials[p.thread_in_block()] = f(p); });
    return block_sum_on_host(partials.data(), threads());
  }
  template <class F>
  float max(F&& f) {
    std::vector<float> partials(threads());
    for_threads([&](const ThreadPos& p) { partials[p.thread_in_block()] = f(p); });
    return block_max_on_host(partials.data(), threads());
  }

 private:
  unsigned threads() const { return pos_.block_dim.x * pos_.block_dim.y; }
  template <class F>
  void for_threads(F&& f) {
    for (pos_.thread.y = 0; pos_.thread.y < pos_.block_dim.y; ++pos_.thread.y)
      for (pos_.thread.x = 0; pos_.thread.x < pos_.block_dim.x; ++pos_.thread.x) f(static_cast<const ThreadPos&>(pos_));
  }
  ThreadPos pos_;
};

// A block program's host run: program(block) for every block of a 1-D grid.
template <class Program>
void for_each_block_on_host(const LaunchShape& s, Program&& program) {
  for (unsigned b = 0; b < s.grid.x; ++b) {
    HostBlock block(s, b);
    program(block);
  }
}

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
