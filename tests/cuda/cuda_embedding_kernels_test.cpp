// The token embedding's kernels (ops/cuda/embedding) against embedding_forward
// and embedding_backward, for every pair of storage types: their bodies over
// the kernels' whole grids on the host, then (skipped without a GPU) the real
// kernels. Copies, conversions and the in-order adds are the CPU op's
// arithmetic, so every comparison is bit for bit.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

#include "anvil/core/dtype.h"
#include "anvil/core/tensor.h"
#include "anvil/ops/cuda/embedding.h"
#include "anvil/ops/cuda/embedding_body.h"
#include "anvil/ops/embedding.h"
#include "cuda_test_util.h"
#include "kernel_check_util.h"

namespace {

using namespace anvil;
using anvil::kernel::LaunchShape;
using anvil::kernel::ThreadPos;
using anvil::testing::DeviceArray;
using anvil::testing::dtype_for;
using anvil::testing::values;

// Odd sizes: D spans a full and a partial block of columns; few ids, many
// tokens, so ids repeat (the backward's order matters).
constexpr int64_t kM = 1003, kV = 97, kD = 300;

template <class T>
std::vector<T> random_storage(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<T> x(static_cast<size_t>(n));
  for (T& v : x) {
    if constexpr (std::is_same_v<T, float>)
      v = dist(rng);
    else
      v = bf16::from_float(dist(rng));
  }
  // A signalling NaN with a payload: a same-type copy keeps its bits.
  if constexpr (std::is_same_v<T, float>)
    x[5] = std::numeric_limits<float>::signaling_NaN();
  else
    x[5] = 0x7f81;
  return x;
}

std::vector<int32_t> random_tokens(uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(kM);
  for (int32_t& v : t) v = static_cast<int32_t>(rng() % kV);
  return t;
}

template <class T>
Tensor tensor_of(const std::vector<T>& x, int64_t rows) {
  Tensor t = Tensor::empty({rows, static_cast<int64_t>(x.size()) / rows}, dtype_for<T>(), MemCategory::workspace, "x");
  std::memcpy(t.raw(), x.data(), t.nbytes());
  return t;
}
Tensor tokens_tensor(const std::vector<int32_t>& t) {
  Tensor r = Tensor::empty({static_cast<int64_t>(t.size())}, DType::i32, MemCategory::workspace, "tokens");
  std::memcpy(r.raw(), t.data(), r.nbytes());
  return r;
}
template <class T>
size_t bit_mismatches(const std::vector<T>& a, const std::vector<T>& b) {
  size_t bad = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) bad += std::memcmp(&a[i], &b[i], sizeof(T)) != 0;
  return bad;
}

template <class S, class Dst>
std::vector<Dst> cpu_forward(const std::vector<int32_t>& tokens, const std::vector<S>& table) {
  Tensor out = Tensor::zeros({kM, kD}, dtype_for<Dst>(), MemCategory::workspace, "out");
  embedding_forward(tokens_tensor(tokens), tensor_of(table, kV), out);
  return values<Dst>(out);
}

template <class S, class G>
std::vector<G> cpu_backward(const std::vector<S>& dout, const std::vector<int32_t>& tokens, const std::vector<G>& dtable) {
  Tensor dt = tensor_of(dtable, kV);
  embedding_backward(tensor_of(dout, kM), tokens_tensor(tokens), dt);
  return values<G>(dt);
}

template <class S, class Dst>
void check_forward_on_host() {
  const std::vector<int32_t> tokens = random_tokens(1);
  const std::vector<S> table = random_storage<S>(kV * kD, 2);
  const std::vector<Dst> want = cpu_forward<S, Dst>(tokens, table);
  // The kernel's grid, and a small one whose threads stride over rows and columns.
  for (const LaunchShape& s : {kernel::embedding_forward_launch_shape(kM, kD), LaunchShape{{1, 7}, {256, 1}}}) {
    std::vector<Dst> out(static_cast<size_t>(kM * kD));
    kernel::for_each_thread_on_host(s, [&](const ThreadPos& p) {
      kernel::embedding_forward_body(p, tokens.data(), kM, table.data(), kV, kD, out.data());
    });
    EXPECT_EQ(bit_mismatches(out, want), 0u) << s.grid.x << "x" << s.grid.y << " blocks";
  }
}

template <class S, class G>
void check_backward_on_host() {
  const std::vector<int32_t> tokens = random_tokens(3);
  const std::vector<S> dout = random_storage<S>(kM * kD, 4);
  const std::vector<G> dtable = random_storage<G>(kV * kD, 5);  // accumulated into
  const std::vector<G> want = cpu_backward(dout, tokens, dtable);
  for (const LaunchShape& s : {kernel::embedding_backward_launch_shape(kD), LaunchShape{{1, 1}, {128, 1}}}) {
    std::vector<G> got = dtable;
    kernel::for_each_thread_on_host(s, [&](const ThreadPos& p) {
      kernel::embedding_backward_body(p, dout.data(), tokens.data(), kM, kV, kD, got.data());
    });
    EXPECT_EQ(bit_mismatches(got, want), 0u) << s.grid.x << " blocks";
  }
}

TEST(CudaEmbeddingBody, ForwardEqualsEmbeddingForwardBitForBit) {
  check_forward_on_host<float, float>();
  check_forward_on_host<float, uint16_t>();
  check_forward_on_host<uint16_t, float>();
  check_forward_on_host<uint16_t, uint16_t>();
}

TEST(CudaEmbeddingBody, BackwardEqualsEmbeddingBackwardBitForBit) {
  check_backward_on_host<float, float>();
  check_backward_on_host<float, uint16_t>();
  check_backward_on_host<uint16_t, float>();
  check_backward_on_host<uint16_t, uint16_t>();
}

// The CPU op throws on an id outside [0, V); the kernels cannot, and must not
// touch memory outside the table instead: a zero row forward, nothing added backward.
TEST(CudaEmbeddingBody, AnIdOutsideTheVocabularyTouchesNothingOutsideTheTable) {
  const std::vector<int32_t> tokens = {3, -1, static_cast<int32_t>(kV), 3};
  const int64_t M = 4;
  const std::vector<float> table = random_storage<float>(kV * kD, 6);
  std::vector<float> out(static_cast<size_t>(M * kD), 1.0f);
  kernel::for_each_thread_on_host(kernel::embedding_forward_launch_shape(M, kD), [&](const ThreadPos& p) {
    kernel::embedding_forward_body(p, tokens.data(), M, table.data(), kV, kD, out.data());
  });
  for (int64_t j = 0; j < kD; ++j) {
    EXPECT_EQ(out[static_cast<size_t>(kD + j)], 0.0f);
    EXPECT_EQ(out[static_cast<size_t>(2 * kD + j)], 0.0f);
    EXPECT_EQ(std::memcmp(&out[static_cast<size_t>(j)], &table[static_cast<size_t>(3 * kD + j)], 4), 0);
  }
  std::vector<float> dtable(static_cast<size_t>(kV * kD), 0.0f);
  const std::vector<float> dout(static_cast<size_t>(M * kD), 1.0f);
  kernel::for_each_thread_on_host(kernel::embedding_backward_launch_shape(kD), [&](const ThreadPos& p) {
    kernel::embedding_backward_body(p, dout.data(), tokens.data(), M, kV, kD, dtable.data());
  });
  for (int64_t i = 0; i < kV * kD; ++i) EXPECT_EQ(dtable[static_cast<size_t>(i)], i / kD == 3 ? 2.0f : 0.0f) << i;
}

template <class S, class Dst>
void check_forward_on_gpu() {
  const std::vector<int32_t> tokens = random_tokens(1);
  const std::vector<S> table = random_storage<S>(kV * kD, 2);
  const DeviceArray<int32_t> d_tokens(tokens);
  const DeviceArray<S> d_table(table);
  const DeviceArray<Dst> d_out(std::vector<Dst>(static_cast<size_t>(kM * kD)));
  embedding_forward_cuda(d_tokens.get(), kM, d_table.get(), kV, kD, d_out.get(), nullptr);
  EXPECT_EQ(bit_mismatches(d_out.download(), cpu_forward<S, Dst>(tokens, table)), 0u);
}

template <class S, class G>
void check_backward_on_gpu() {
  const std::vector<int32_t> tokens = random_tokens(3);
  const std::vector<S> dout = random_storage<S>(kM * kD, 4);
  const std::vector<G> dtable = random_storage<G>(kV * kD, 5);
  const DeviceArray<int32_t> d_tokens(tokens);
  const DeviceArray<S> d_dout(dout);
  const DeviceArray<G> d_dtable(dtable);
  embedding_backward_cuda(d_dout.get(), d_tokens.get(), kM, kV, kD, d_dtable.get(), nullptr);
  EXPECT_EQ(bit_mismatches(d_dtable.download(), cpu_backward(dout, tokens, dtable)), 0u);
}

TEST(CudaEmbeddingKernel, EqualsTheCpuOpBitForBit) {
  SKIP_WITHOUT_GPU();
  check_forward_on_gpu<float, float>();
  check_forward_on_gpu<float, uint16_t>();
  check_forward_on_gpu<uint16_t, float>();
  check_forward_on_gpu<uint16_t, uint16_t>();
  check_backward_on_gpu<float, float>();
  check_backward_on_gpu<float, uint16_t>();
  check_backward_on_gpu<uint16_t, float>();
  check_backward_on_gpu<uint16_t, uint16_t>();
}

}  // namespace
