#include "anvil/ops/moe_experts.h"

#include <algorithm>
#include <atomic>
#include <set>

#include "anvil/core/error.h"
#include "anvil/core/op_timer.h"
#include "anvil/core/parallel_for.h"
#include "anvil/ops/matmul.h"

namespace anvil {

namespace {

// One product of the call: expert e's rows [r0, r0 + rows).
struct Task {
  int64_t e, r0, rows;
};

void check_offsets(const std::vector<int64_t>& offsets, int64_t E, int64_t R, const char* what) {
  ANVIL_ASSERT(static_cast<int64_t>(offsets.size()) == E + 1 && offsets.front() == 0 && offsets.back() == R, what,
               ": ", offsets.size(), " offsets ending at ", offsets.empty() ? -1 : offsets.back(), " for ", E,
               " experts over ", R, " rows");
  for (size_t e = 0; e + 1 < offsets.size(); ++e)
    ANVIL_ASSERT(offsets[e] <= offsets[e + 1], what, ": offsets must ascend (expert ", e, ")");
}

// Each expert's rows in blocks of at most `block`.
std::vector<Task> row_blocks(const std::vector<int64_t>& offsets, int64_t block) {
  std::vector<Task> tasks;
  for (size_t e = 0; e + 1 < offsets.size(); ++e)
    for (int64_t r = offsets[e]; r < offsets[e + 1]; r += block)
      tasks.push_back({static_cast<int64_t>(e), r, std::min(block, offsets[e + 1] - r)});
  return tasks;
}

// The scratchpad for the products of `blocks` (shape_of(rows) a block's
// product): a whole block's, or more if a smaller block needs more. A whole
// block's whatever the routing, so the op's memory does not depend on the
// data and the dry run's balanced case allocates what a real run does
// (oneDNN's scratchpad grows with M up to its own blocking, so a whole
// block's is the most in practice; a larger need would show in the allocator).
template <class ShapeOf>
size_t routing_independent_scratchpad(const std::vector<Task>& blocks, int64_t block, ShapeOf&& shape_of) {
  std::set<int64_t> sizes{block};
  for (const Task& b : blocks) sizes.insert(b.rows);
  size_t need = 0;
  for (int64_t rows : sizes) need = std::max(need, gemm_scratchpad_bytes(shape_of(rows)));
  return need;
}

// Runs run(task, scratchpad) for every task over the threads, each product
// single-threaded with its thread's own oneDNN scratchpad of `need` bytes,
// allocated before the region so the op's memory is fixed when it starts (one
// per thread, however many tasks the routing made). The threads take tasks
// from a shared counter, so uneven experts even out.
template <class Run>
void run_tasks(const std::vector<Task>& tasks, size_t need, Run&& run, const char* tag) {
  const int64_t n = static_cast<int64_t>(tasks.size());
  const int64_t slots = omp_in_parallel() ? 1 : std::max<int64_t>(1, num_threads());
  const size_t stride = (need + 63) / 64 * 64;
  Tensor scratch;
  if (stride > 0)
    scratch = Tensor::empty({slots * static_cast<int64_t>(stride / 2)}, DType::bf16, MemCategory::workspace, tag);
  if (dry_run() || n == 0) return;
  std::atomic<int64_t> next{0};
  parallel_for(0, slots, 1, [&](int64_t slot, int64_t slot_end) {
    ANVIL_ASSERT(slot_end == slot + 1, "one scratchpad per thread");
    void* sp = stride > 0 ? static_cast<char*>(scratch.raw()) + static_cast<size_t>(slot) * stride : nullptr;
    for (int64_t i; (i = next.fetch_add(1)) < n;) run(tasks[static_cast<size_t>(i)], sp);
  });
}

// out[rows of e] (+)= a[rows of e] · op(w[e]) for every expert, in row
// blocks: `shape` is the product with its M left to each block.
void row_block_products(const Tensor& a, const Tensor& w, const std::vector<int64_t>& offsets, Tensor& out,
                        const GemmShape& shape) {
  const int64_t es = dtype_size(a.dtype()), a_row = a.size(1), out_row = out.size(1),
                w_step = w.size(1) * w.size(2);
  const auto shape_of = [&](int64_t rows) {
    GemmShape s = shape;
    s.M = rows;
    if (rows != kGroupedRowBlock) s.runtime = RuntimeDim::m;  // a tail: one kernel for every count
    return s;
  };
  const std::vector<Task> blocks = row_blocks(offsets, kGroupedRowBlock);
  run_tasks(
      blocks, routing_independent_scratchpad(blocks, kGroupedRowBlock, shape_of),
      [&](const Task& t, void* sp) {
        gemm(shape_of(t.rows), static_cast<const char*>(a.raw()) + t.r0 * a_row * es,
             static_cast<const char*>(w.raw()) + t.e * w_step * es, static_cast<char*>(out.raw()) + t.r0 * out_row * es,
             sp);
      },
      "moe.experts.gemm_scratchpad");
}

double grouped_flops(int64_t R, int64_t N, int64_t K) {
  return 2.0 * static_cast<double>(R) * static_cast<double>(N) * static_cast<double>(K);
}

}  // namespace

void grouped_linear_forward(const Tensor& x, const Tensor& w, const std::vector<int64_t>& offsets, Tensor& y) {
  const int64_t R = x.size(0), K = x.size(1), E = w.size(0), N = w.size(1);
  ANVIL_ASSERT(x.ndim() == 2 && w.ndim() == 3 && w.size(2) == K && y.ndim() == 2 && y.size(0) == R &&
                   y.size(1) == N && x.dtype() == w.dtype() && y.dtype() == x.dtype(),
               "grouped linear: x ", shape_str(x.shape()), " w ", shape_str(w.shape()), " y ", shape_str(y.shape()));
  check_offsets(offsets, E, R, "grouped linear");
  const ScopedOpTime op("moe.experts.forward", grouped_flops(R, N, K));
  row_block_products(x, w, offsets, y, {.M = 0, .N = N, .K = K, .trans_b = true, .ab = x.dtype(), .c = x.dtype()});
}

void grouped_linear_backward_input(const Tensor& dy, const Tensor& w, const std::vector<int64_t>& offsets,
                                   Tensor& dx, bool accumulate) {
  const int64_t R = dy.size(0), N = dy.size(1), E = w.size(0), K = w.size(2);
  ANVIL_ASSERT(dy.ndim() == 2 && w.ndim() == 3 && w.size(1) == N && dx.ndim() == 2 && dx.size(0) == R &&
                   dx.size(1) == K && dy.dtype() == w.dtype() && dx.dtype() == dy.dtype(),
               "grouped linear backward: dy ", shape_str(dy.shape()), " w ", shape_str(w.shape()), " dx ",
               shape_str(dx.shape()));
  check_offsets(offsets, E, R, "grouped linear backward");
  const ScopedOpTime op("moe.experts.backward_input", grouped_flops(R, N, K));
  row_block_products(dy, w, offsets, dx,
                     {.M = 0, .N = K, .K = N, .ab = dy.dtype(), .c = dy.dtype(), .accumulate = accumulate});
}

void grouped_linear_backward_weight(const Tensor& dy, const Tensor& x, const std::vector<int64_t>& offsets,
                                    Tensor& dw) {
  const int64_t R = dy.size(0), N = dy.size(1), K = x.size(1), E = dw.size(0);
  ANVIL_ASSERT(dy.ndim() == 2 && x.ndim() == 2 && x.size(0) == R && dw.ndim() == 3 && dw.size(1) == N &&
                   dw.size(2) == K && dy.dtype() == x.dtype() && dw.dtype() != DType::i32,
               "grouped linear weight gradient: dy ", shape_str(dy.shape()), " x ", shape_str(x.shape()), " dw ",
               shape_str(dw.shape()));
  check_offsets(offsets, E, R, "grouped linear weight gradient");
  const ScopedOpTime op("moe.experts.backward_weight", grouped_flops(R, N, K));
  const DType dt = dy.dtype();
  const int64_t es = dtype_size(dt), ws = dtype_size(dw.dtype());
  const auto shape_of = [&](int64_t rows) {
    return GemmShape{.M = N,
                     .N = K,
                     .K = rows,
                     .trans_a = true,
                     .lda = N,
                     .ab = dt,
                     .c = dw.dtype(),
                     .accumulate = true,
                     .runtime = rows == kGroupedWeightBlock ? RuntimeDim::none : RuntimeDim::k};
  };
  // One task per expert with rows (it alone adds into dw[e]), its blocks in row order.
  std::vector<Task> tasks;
  for (size_t e = 0; e + 1 < offsets.size(); ++e)
    if (offsets[e + 1] > offsets[e])
      tasks.push_back({static_cast<int64_t>(e), offsets[e], offsets[e + 1] - offsets[e]});
  run_tasks(
      tasks, routing_independent_scratchpad(row_blocks(offsets, kGroupedWeightBlock), kGroupedWeightBlock, shape_of),
      [&](const Task& t, void* sp) {
        for (int64_t r = t.r0; r < t.r0 + t.rows; r += kGroupedWeightBlock) {
          const int64_t rows = std::min(kGroupedWeightBlock, t.r0 + t.rows - r);
          gemm(shape_of(rows), static_cast<const char*>(dy.raw()) + r * N * es,
               static_cast<const char*>(x.raw()) + r * K * es, static_cast<char*>(dw.raw()) + t.e * N * K * ws, sp);
        }
      },
      "moe.experts.gemm_scratchpad");
}

}  // namespace anvil
