#include "anvil/plan/memory.h"

#include <algorithm>
#include <array>
#include <fstream>
#include <sstream>

#include "anvil/core/parallel.h"
#include "anvil/model/params.h"
#include "anvil/ops/attention.h"
#include "anvil/ops/cross_entropy.h"
#include "anvil/ops/matmul.h"
#include "anvil/plan/memory_sim.h"

namespace anvil {

namespace {

struct Dims {
  size_t M, D, Dq, Dkv, F, lse, e;  // e: bytes per activation element
};

Dims dims_of(const ModelArgs& a, const TrainShape& s) {
  const size_t M = static_cast<size_t>(s.local_batch_size * s.seq_len);
  return {M,
          static_cast<size_t>(a.dim),
          static_cast<size_t>(a.n_heads * a.head_dim()),
          static_cast<size_t>(a.n_kv_heads * a.head_dim()),
          static_cast<size_t>(a.ffn_hidden_dim()),
          static_cast<size_t>(s.local_batch_size * a.n_heads * s.seq_len) * 4,
          dtype_size(s.compute_dtype)};
}

// Everything block_forward produces, in bytes (BlockSaved with no policy applied, x included).
size_t block_all_bytes(const Dims& d) {
  return d.M * d.e * (3 * d.D /* x, h1, x2 */ + d.D /* h2 */ + 2 * d.Dq /* q, o */ + 2 * d.Dkv /* k, v */ +
                      3 * d.F /* g, u, s */) +
         2 * d.M * 4 /* rstd1, rstd2 */ + d.lse;
}

}  // namespace

size_t block_saved_bytes(const ModelArgs& args, const TrainShape& shape, int layer) {
  const Dims d = dims_of(args, shape);
  if (shape.ac.recomputes_whole_block(layer)) return d.M * d.D * d.e;  // the input only
  if (shape.ac.mode == AcMode::selective_op)  // drops h1, rstd1, h2, rstd2, s
    return block_all_bytes(d) - d.M * d.e * (2 * d.D + d.F) - 2 * d.M * 4;
  return block_all_bytes(d);
}

size_t step_workspace_bytes(const ModelArgs& args, const TrainShape& shape) {
  // What stays allocated through a step: the RoPE table, cos and sin of
  // (T, head_dim/2) f32 (the model is built for seq_len), and every
  // micro-batch's token and target batches (i32).
  const size_t T = static_cast<size_t>(shape.seq_len), B = static_cast<size_t>(shape.local_batch_size);
  const size_t rope = T * static_cast<size_t>(args.head_dim()) * 4;
  return rope + static_cast<size_t>(std::max<int64_t>(1, shape.micro_batches)) * B * T * 4 * 2;
}

namespace {
std::array<size_t, 5> op_scratch_terms(const ModelArgs& args, const TrainShape& shape, int tp, bool loss_parallel);

// How a training step's loss head blocks M rows of a V-entry vocabulary (per
// rank): the fused kernel's blocking, or the loss-parallel shard kernels'.
CrossEntropyBlocking loss_head_blocking(int64_t M, int64_t V, bool shards) {
  return shards ? cross_entropy_shard_blocking(M, V) : cross_entropy_blocking(M, V, /*backward=*/true);
}
}  // namespace

size_t op_scratch_bytes(const ModelArgs& args, const TrainShape& shape, int tp, bool loss_parallel) {
  const std::array<size_t, 5> t = op_scratch_terms(args, shape, tp, loss_parallel);
  return *std::max_element(t.begin(), t.end());
}

size_t op_scratch_cached_bytes(const ModelArgs& args, const TrainShape& shape, int tp, bool loss_parallel) {
  size_t sum = 0;
  for (size_t term : op_scratch_terms(args, shape, tp, loss_parallel))
    if (cached_block_bytes(term) <= kCachedBlockMax) sum += cached_block_bytes(term);
  return sum;
}

namespace {
std::array<size_t, 5> op_scratch_terms(const ModelArgs& args, const TrainShape& shape, int tp, bool loss_parallel) {
  // The largest of the per-op scratch buffers, which are never live at the
  // same time. Each term follows the allocations of the op named; oneDNN's
  // own GEMM scratchpad ("gemm.scratchpad", grown per thread to the largest
  // primitive run) is its implementation's choice and is not included.
  // docs/memory.md lists the terms. Under tensor parallelism each rank runs
  // its heads, feed-forward columns and vocabulary rows.
  const Dims d = dims_of(args, shape);
  const bool bf16 = shape.compute_dtype == DType::bf16;
  const size_t T = static_cast<size_t>(shape.seq_len), B = static_cast<size_t>(shape.local_batch_size);
  const auto t = static_cast<size_t>(tp);
  const size_t hd = static_cast<size_t>(args.head_dim()), group = static_cast<size_t>(args.n_heads / args.n_kv_heads);
  const size_t Dq = d.Dq / t, F = d.F / t;
  // Loss head (ops/cross_entropy.cpp): f32 logits of one row block × vocabulary
  // chunk and 4 f32 stats per row; in bf16 also the bf16 dlogits and an f32 dx
  // accumulator of the row block. Loss parallel adds 5 f32 per row (stats, max, lse).
  const size_t vocab = tp > 1 && loss_parallel ? (static_cast<size_t>(args.vocab_size) + t - 1) / t
                                               : static_cast<size_t>(args.vocab_size);
  // The fused kernel may keep a row block's logits of every chunk (cross_entropy_blocking); the
  // loss-parallel shard kernels never do.
  const CrossEntropyBlocking blocking =
      loss_head_blocking(static_cast<int64_t>(d.M), static_cast<int64_t>(vocab), tp > 1 && loss_parallel);
  const auto row_block = static_cast<size_t>(blocking.rows), vocab_chunk = static_cast<size_t>(blocking.chunk);
  const size_t logits_width = blocking.keep_logits ? vocab : vocab_chunk;
  const size_t ce = row_block * logits_width * 4 + 4 * row_block * 4 +
                    (bf16 ? row_block * vocab_chunk * 2 + row_block * d.D * 4 : 0) +
                    (tp > 1 && loss_parallel ? 5 * d.M * 4 : 0);
  // Attention (ops/attention.cpp): scratch per thread, each thread of the
  // parallel loop allocating its own; in the backward with several splits per
  // (batch, kv head), an f32 dQ partial of the whole output per split.
  const AttentionTiles tiles;
  const auto diagonal_tile = [&](int64_t tile) { return static_cast<size_t>(attention_diagonal_tile(tile, shape.seq_len)); };
  const size_t owners = B * static_cast<size_t>(args.n_kv_heads) / t;
  const size_t threads = static_cast<size_t>(shape.threads > 0 ? shape.threads : num_threads());
  const auto splits_for = [&](size_t tiles_along_t) {  // tiles go in causal-balanced pairs
    return static_cast<size_t>(attention_task_splits(static_cast<int64_t>(owners),
                                                     static_cast<int64_t>((tiles_along_t + 1) / 2),
                                                     static_cast<int64_t>(threads)));
  };
  const size_t fq = diagonal_tile(tiles.fwd_q), fk = std::min<size_t>(static_cast<size_t>(tiles.fwd_k), T);
  // Packed operands and P/dS in the products' dtype: f32 when bf16 attention runs widened.
  const size_t ea = attention_products_widened(shape.compute_dtype) ? 4 : d.e;
  const size_t attn_fwd_thread = 2 * T * hd * ea + fq * hd * ea + fq * fk * (4 + ea) + fq * hd * 4 + 2 * fq * 4;
  const size_t fwd_splits = splits_for((T + fq - 1) / fq);
  const size_t attn_fwd = std::min(threads, owners * fwd_splits) * attn_fwd_thread;
  const size_t bq = std::min<size_t>(static_cast<size_t>(tiles.bwd_q), T), bk = diagonal_tile(tiles.bwd_k);
  const size_t attn_bwd_thread = 2 * T * hd * ea + 2 * group * T * hd * ea + group * T * hd * 4 + 2 * group * T * 4 +
                                 2 * bk * bq * (4 + ea) + 2 * bk * hd * 4;
  const size_t bwd_splits = splits_for((T + bk - 1) / bk);
  const size_t attn_bwd = std::min(threads, owners * bwd_splits) * attn_bwd_thread +
                          (bwd_splits > 1 ? bwd_splits * d.M * Dq * 4 : 0);
  // A weight gradient's f32 partial (ops/matmul.cpp, bf16 only): the largest
  // block weight, w1/w2/w3 (F × D) or wq/wo (Dq × D).
  // (Widened bf16 products take the f32 route instead, without one.)
  const size_t weight_grad = bf16 && !bf16_products_widened() ? std::max(F, Dq) * d.D * 4 : 0;
  // RMSNorm's weight gradient (ops/rmsnorm.cpp): one f32 row per chunk of rows.
  // (M rows at most: sequence parallelism gives each rank M / tp.)
  const size_t norm_rows = std::max<size_t>(16, (size_t{1} << 19) / d.D);
  const size_t norm = (d.M + norm_rows - 1) / norm_rows * d.D * 4;
  return {ce, attn_fwd, attn_bwd, weight_grad, norm};
}
}  // namespace

size_t widened_product_bytes(const ModelArgs& args, const TrainShape& shape, int tp, bool loss_parallel,
                             bool with_head) {
  if (shape.compute_dtype != DType::bf16 || !bf16_products_widened()) return 0;
  // Every product a step runs outside a parallel region, as the model calls
  // it (transformer_block.cpp, parallel_plan.cpp, tensor_parallel.cpp,
  // cross_entropy.cpp); attention's tile products run natively.
  const Dims d = dims_of(args, shape);
  const auto t = static_cast<int64_t>(tp);
  const auto M = static_cast<int64_t>(d.M), D = static_cast<int64_t>(d.D), Dq = static_cast<int64_t>(d.Dq) / t,
             Dkv = static_cast<int64_t>(d.Dkv) / t, F = static_cast<int64_t>(d.F) / t;
  const DType bf = DType::bf16;
  // Row-parallel outputs and input gradients go into an f32 partial under tensor parallelism.
  const DType summed = tp > 1 ? DType::f32 : bf;
  std::vector<GemmShape> products;
  const auto forward = [&](int64_t K, int64_t N, DType c) {  // y (M, N) (+)= x (M, K) · w (N, K)ᵀ
    products.push_back({.M = M, .N = N, .K = K, .trans_b = true, .ab = bf, .c = c});
  };
  const auto input_grad = [&](int64_t N, int64_t K, DType c) {  // dx (M, K) = dy (M, N) · w (N, K)
    products.push_back({.M = M, .N = K, .K = N, .ab = bf, .c = c});
  };
  const auto weight_grad = [&](int64_t N, int64_t K) {  // dw (N, K) += dyᵀ · x, dw f32
    products.push_back({.M = N, .N = K, .K = M, .trans_a = true, .ab = bf, .c = DType::f32, .accumulate = true});
  };
  forward(D, Dq, bf), forward(D, Dkv, bf), forward(Dq, D, summed), forward(D, F, bf), forward(F, D, summed);
  input_grad(D, F, bf), input_grad(F, D, summed), input_grad(D, Dq, bf), input_grad(Dq, D, summed),
      input_grad(Dkv, D, summed);
  weight_grad(D, F), weight_grad(F, D), weight_grad(D, Dq), weight_grad(Dq, D), weight_grad(Dkv, D);
  if (with_head) {
    // The loss head: per row block, the logits of a vocabulary chunk, then dx and dw products.
    const int64_t V = tp > 1 && loss_parallel ? (args.vocab_size + t - 1) / t : args.vocab_size;
    const CrossEntropyBlocking blocking = loss_head_blocking(M, V, tp > 1 && loss_parallel);
    const int64_t R = blocking.rows, C = blocking.chunk;
    products.push_back({.M = R, .N = C, .K = D, .trans_b = true, .ab = bf, .c = DType::f32});
    products.push_back({.M = R, .N = D, .K = C, .ab = bf, .c = DType::f32, .accumulate = true});
    products.push_back({.M = C, .N = D, .K = R, .trans_a = true, .ab = bf, .c = DType::f32, .accumulate = true});
  }
  WidenedBytes most;
  for (const GemmShape& p : products) {
    const WidenedBytes w = widened_operand_bytes(p);
    most.a = std::max(most.a, w.a), most.b = std::max(most.b, w.b), most.c = std::max(most.c, w.c);
  }
  return most.a + most.b + most.c;
}

MemoryEstimate estimate_memory(const ModelArgs& args, const TrainShape& shape) {
  MemoryEstimate est;
  // Parameters live in flat buffers padded per tensor (ParamStore).
  const size_t P = static_cast<size_t>(padded_numel(llama_param_specs(args)));
  const bool bf16 = shape.compute_dtype == DType::bf16;
  est.peak[static_cast<int>(MemCategory::parameters)] = P * 4 + (bf16 ? P * 2 : 0);
  est.peak[static_cast<int>(MemCategory::gradients)] = P * 4;
  est.peak[static_cast<int>(MemCategory::optimizer_state)] = P * 8;

  // Activations: a replay of forward_backward's allocations (memory_sim.h).
  {
    MemSim sim;
    ModelSim model(sim, {args, shape.local_batch_size, shape.seq_len, shape.compute_dtype, shape.ac},
                   {{0, llama_num_modules(args)}}, nullptr, [] {});
    SimStageSaved saved;
    (void)model.forward(0, nullptr, saved);
    (void)model.backward_from_loss(0, saved, /*split=*/false);
    est.peak[static_cast<int>(MemCategory::activations)] = sim.peak(MemCategory::activations);
  }
  est.peak[static_cast<int>(MemCategory::workspace)] =
      step_workspace_bytes(args, shape) + widened_product_bytes(args, shape) + op_scratch_bytes(args, shape);

  for (size_t b : est.peak) est.peak_total += b;
  return est;
}

size_t available_memory_bytes() {
  size_t avail = 0;
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  size_t value;
  std::string unit;
  while (meminfo >> key >> value >> unit)
    if (key == "MemAvailable:") avail = value * 1024;
  auto read_number = [](const char* path, size_t& out) {
    std::ifstream f(path);
    std::string s;
    if (!(f >> s) || s == "max") return false;
    out = std::stoull(s);
    return true;
  };
  size_t limit = 0, usage = 0;
  if (read_number("/sys/fs/cgroup/memory.max", limit) && read_number("/sys/fs/cgroup/memory.current", usage))
    avail = std::min(avail, limit > usage ? limit - usage : 0);
  return avail;
}

}  // namespace anvil
