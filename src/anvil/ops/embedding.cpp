#include "anvil/ops/embedding.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <string>
#include <type_traits>

#include "anvil/core/dry_run.h"
#include "anvil/core/op_timer.h"
#include "anvil/core/parallel_for.h"
#include "anvil/ops/gpu_kernels.h"
#include "anvil/ops/vec16.h"

namespace anvil {

// Every id must be in [0, V) before any row moves: a bad id would read or write
// outside the table. Checked up front, on the calling thread, because an
// exception must not leave an OpenMP region. The scan is branch-free (it
// vectorises); the slow search for the first offender runs only on failure.
void check_token_ids(const Tensor& tokens, int64_t V, const char* what) {
  const int32_t* t = tokens.data<int32_t>();
  const int64_t M = tokens.numel();
  // As unsigned 32-bit, a negative id becomes >= 2^31 >= any vocabulary an i32 id can index.
  const uint32_t vocab = static_cast<uint32_t>(std::min<int64_t>(V, int64_t{1} << 31));
  uint32_t bad = 0;
  for (int64_t m = 0; m < M; ++m) bad |= static_cast<uint32_t>(t[m]) >= vocab ? 1u : 0u;
  if (!bad) return;
  for (int64_t m = 0; m < M; ++m) {
    if (t[m] >= 0 && t[m] < V) continue;
    std::string where = "position " + std::to_string(m);
    if (tokens.ndim() == 2)
      where += " (sequence " + std::to_string(m / tokens.size(1)) + ", token " + std::to_string(m % tokens.size(1)) + ")";
    ANVIL_CHECK(false, what, ": token id ", t[m], " at ", where, " is outside the vocabulary [0, ", V,
                "); the tokenizer and the model's vocab_size disagree, or the data file is not made of ids of this "
                "tokenizer");
  }
}

namespace {

using namespace vec16;  // the 16-lane vector helpers (ops/vec16.h)

// Converts/copies one row segment of n elements.
template <class S, class Dst>
inline void convert_row(const S* src, Dst* dst, int64_t n) {
  if constexpr (std::is_same_v<S, Dst>) {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(S));
  } else {
    int64_t j = 0;
    for (; j + kW <= n; j += kW) store(dst + j, load(src + j));
    if (j < n) store(dst + j, load(src + j, n - j), n - j);
  }
}

template <class S, class Dst>
void gather(const int32_t* tok, const S* table, Dst* out, int64_t M, int64_t D) {
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, D));
  parallel_for(0, M, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t m = lo; m < hi; ++m) convert_row(table + static_cast<int64_t>(tok[m]) * D, out + m * D, D);
  });
}

// The shard's gather: ids in [begin, begin + rows) read row id − begin, the others give zeros.
template <class S, class Dst>
void gather_shard(const int32_t* tok, const S* table, int64_t begin, int64_t rows, Dst* out, int64_t M, int64_t D) {
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, D));
  parallel_for(0, M, grain, [&](int64_t lo, int64_t hi) {
    for (int64_t m = lo; m < hi; ++m) {
      const int64_t r = static_cast<int64_t>(tok[m]) - begin;
      if (r >= 0 && r < rows)
        convert_row(table + r * D, out + m * D, D);
      else
        std::memset(static_cast<void*>(out + m * D), 0, static_cast<size_t>(D) * sizeof(Dst));
    }
  });
}

// Scatter-add, parallel over COLUMN blocks of dtable: every thread walks all M
// tokens in order but touches only its own columns, so no two threads ever
// write the same element (race-free without atomics or a sort), repeated ids
// add up in token order (deterministic, the same sum as a serial loop), and the
// work splits evenly however skewed the token distribution is (frequent tokens
// tend to have low ids in BPE vocabularies, so splitting the vocabulary among threads
// would load one thread far more than the other). Blocks are 32 columns, a
// whole 64-byte line of bf16 and two of f32, so threads never share a cache
// line. A thread's share of a row is D/threads contiguous elements (1024 at
// D = 2048 on 2 cores): long enough to stream well.
template <class S, class G>
void scatter_add(const int32_t* tok, const S* dout, G* dtable, int64_t M, int64_t D) {
  constexpr int64_t kBlock = 32;
  const int64_t blocks = (D + kBlock - 1) / kBlock;
  // Enough blocks per task that each task adds at least ~32K elements.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, M * kBlock));
  parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    const int64_t c0 = b0 * kBlock, c1 = std::min(D, b1 * kBlock), n = c1 - c0;
    for (int64_t m = 0; m < M; ++m) {
      const S* src = dout + m * D + c0;
      G* dst = dtable + static_cast<int64_t>(tok[m]) * D + c0;
      int64_t j = 0;
      for (; j + kW <= n; j += kW) store(dst + j, load(dst + j) + load(src + j));
      if (j < n) store(dst + j, load(dst + j, n - j) + load(src + j, n - j), n - j);
    }
  });
}

// scatter_add restricted to ids in [begin, begin + rows), same column-block split.
template <class S, class G>
void scatter_add_shard(const int32_t* tok, const S* dout, int64_t begin, int64_t rows, G* dtable, int64_t M,
                       int64_t D) {
  constexpr int64_t kBlock = 32;
  const int64_t blocks = (D + kBlock - 1) / kBlock;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(1, M * kBlock));
  parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    const int64_t c0 = b0 * kBlock, c1 = std::min(D, b1 * kBlock), n = c1 - c0;
    for (int64_t m = 0; m < M; ++m) {
      const int64_t r = static_cast<int64_t>(tok[m]) - begin;
      if (r < 0 || r >= rows) continue;
      const S* src = dout + m * D + c0;
      G* dst = dtable + r * D + c0;
      int64_t j = 0;
      for (; j + kW <= n; j += kW) store(dst + j, load(dst + j) + load(src + j));
      if (j < n) store(dst + j, load(dst + j, n - j) + load(src + j, n - j), n - j);
    }
  });
}

// Calls fn with typed pointers for the dtype pair (a, b).
template <class F>
void dispatch2(const Tensor& a, const Tensor& b, F&& fn) {
  const bool af = a.dtype() == DType::f32, bf = b.dtype() == DType::f32;
  if (af && bf) fn(a.data<float>(), b.data<float>());
  else if (af) fn(a.data<float>(), b.data<bf16>());
  else if (bf) fn(a.data<bf16>(), b.data<float>());
  else fn(a.data<bf16>(), b.data<bf16>());
}

}  // namespace

void embedding_forward(const Tensor& tokens, const Tensor& table, Tensor& out) {
  const ScopedOpTime op("embedding.forward");
  ANVIL_ASSERT(tokens.dtype() == DType::i32, "embedding: tokens must be i32, got ", dtype_name(tokens.dtype()));
  ANVIL_ASSERT(table.ndim() == 2 && table.dtype() != DType::i32 && out.dtype() != DType::i32,
               "embedding: table ", shape_str(table.shape()), " ", dtype_name(table.dtype()), ", out ",
               dtype_name(out.dtype()));
  const int64_t V = table.size(0), D = table.size(1), M = tokens.numel();
  ANVIL_ASSERT(out.numel() == M * D && (out.ndim() == 0 || out.size(-1) == D), "embedding: out ",
               shape_str(out.shape()), " for ", M, " tokens of width ", D);
  if (on_gpu("embedding.forward", tokens, table, out)) {  // the tokens were checked on the host, before the copy
    if (M == 0 || D == 0 || dry_run()) return;
    return gpu_kernels("embedding.forward")
        .embedding_forward(static_cast<const int32_t*>(tokens.raw()), M, table.dtype(), table.raw(), V, D,
                           out.dtype(), out.raw());
  }
  if (dry_run()) return;
  check_token_ids(tokens, V, "embedding_forward");
  if (M == 0 || D == 0) return;
  const int32_t* tok = tokens.data<int32_t>();
  dispatch2(table, out, [&](const auto* tab, auto* o) { gather(tok, tab, o, M, D); });
}

void embedding_backward(const Tensor& dout, const Tensor& tokens, Tensor& dtable) {
  const ScopedOpTime op("embedding.backward");
  ANVIL_ASSERT(tokens.dtype() == DType::i32, "embedding: tokens must be i32, got ", dtype_name(tokens.dtype()));
  ANVIL_ASSERT(dtable.ndim() == 2 && dtable.dtype() != DType::i32 && dout.dtype() != DType::i32,
               "embedding backward: dtable ", shape_str(dtable.shape()), " ", dtype_name(dtable.dtype()), ", dout ",
               dtype_name(dout.dtype()));
  const int64_t V = dtable.size(0), D = dtable.size(1), M = tokens.numel();
  ANVIL_ASSERT(dout.numel() == M * D && (dout.ndim() == 0 || dout.size(-1) == D), "embedding backward: dout ",
               shape_str(dout.shape()), " for ", M, " tokens of width ", D);
  if (on_gpu("embedding.backward", tokens, dout, dtable)) {
    if (M == 0 || D == 0 || dry_run()) return;
    return gpu_kernels("embedding.backward")
        .embedding_backward(dout.dtype(), dout.raw(), static_cast<const int32_t*>(tokens.raw()), M, V, D,
                            dtable.dtype(), dtable.raw());
  }
  if (dry_run()) return;
  check_token_ids(tokens, V, "embedding_backward");
  if (M == 0 || D == 0) return;
  const int32_t* tok = tokens.data<int32_t>();
  dispatch2(dout, dtable, [&](const auto* src, auto* dst) { scatter_add(tok, src, dst, M, D); });
}

void embedding_forward_shard(const Tensor& tokens, const Tensor& table, int64_t vocab_begin, int64_t vocab_size,
                             Tensor& out) {
  const ScopedOpTime op("embedding.forward");
  ANVIL_ASSERT(tokens.dtype() == DType::i32, "embedding: tokens must be i32, got ", dtype_name(tokens.dtype()));
  ANVIL_ASSERT(table.ndim() == 2 && table.dtype() != DType::i32 && out.dtype() != DType::i32 && vocab_begin >= 0,
               "embedding shard: table ", shape_str(table.shape()), " from row ", vocab_begin);
  const int64_t D = table.size(1), M = tokens.numel();
  ANVIL_ASSERT(out.numel() == M * D && (out.ndim() == 0 || out.size(-1) == D), "embedding: out ",
               shape_str(out.shape()), " for ", M, " tokens of width ", D);
  if (dry_run()) return;
  check_token_ids(tokens, vocab_size, "embedding_forward");
  if (M == 0 || D == 0) return;
  const int64_t rows = std::clamp<int64_t>(vocab_size - vocab_begin, 0, table.size(0));  // without the padding
  const int32_t* tok = tokens.data<int32_t>();
  dispatch2(table, out, [&](const auto* tab, auto* o) { gather_shard(tok, tab, vocab_begin, rows, o, M, D); });
}

void embedding_backward_shard(const Tensor& dout, const Tensor& tokens, int64_t vocab_begin, int64_t vocab_size,
                              Tensor& dtable) {
  const ScopedOpTime op("embedding.backward");
  ANVIL_ASSERT(tokens.dtype() == DType::i32, "embedding: tokens must be i32, got ", dtype_name(tokens.dtype()));
  ANVIL_ASSERT(dtable.ndim() == 2 && dtable.dtype() != DType::i32 && dout.dtype() != DType::i32 && vocab_begin >= 0,
               "embedding shard backward: dtable ", shape_str(dtable.shape()), " from row ", vocab_begin);
  const int64_t D = dtable.size(1), M = tokens.numel();
  ANVIL_ASSERT(dout.numel() == M * D && (dout.ndim() == 0 || dout.size(-1) == D), "embedding backward: dout ",
               shape_str(dout.shape()), " for ", M, " tokens of width ", D);
  if (dry_run()) return;
  check_token_ids(tokens, vocab_size, "embedding_backward");
  if (M == 0 || D == 0) return;
  const int64_t rows = std::clamp<int64_t>(vocab_size - vocab_begin, 0, dtable.size(0));
  const int32_t* tok = tokens.data<int32_t>();
  dispatch2(dout, dtable,
            [&](const auto* src, auto* dst) { scatter_add_shard(tok, src, vocab_begin, rows, dst, M, D); });
}

}  // namespace anvil
