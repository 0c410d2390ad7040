#include "anvil/estimate/memory.h"

#include <algorithm>
#include <fstream>

#include "anvil/core/dry_run.h"
#include "anvil/core/parallel_for.h"
#include "anvil/model/params.h"

namespace anvil {

namespace {

struct Dims {
  size_t M, D, Dq, Dkv, F, lse, e;  // e: bytes per activation element
  size_t heads = 0;                 // Qwen3: query and key heads, whose 1/rms the q/k norms keep; 0 without them
  size_t E = 0, R = 0;              // a mixture of experts: experts, routes (M·k); 0 when dense
};

Dims dims_of(const ModelArgs& a, const TrainShape& s) {
  const size_t M = static_cast<size_t>(s.local_batch_size * s.seq_len);
  return {M,
          static_cast<size_t>(a.dim),
          static_cast<size_t>(a.n_heads * a.head_dim()),
          static_cast<size_t>(a.n_kv_heads * a.head_dim()),
          static_cast<size_t>(a.moe() ? a.moe_ffn_hidden : a.ffn_hidden_dim()),
          static_cast<size_t>(s.local_batch_size * a.n_heads * s.seq_len) * 4,
          dtype_size(s.compute_dtype),
          a.qk_norm ? static_cast<size_t>(a.n_heads + a.n_kv_heads) : 0,
          static_cast<size_t>(a.num_experts),
          a.moe() ? M * static_cast<size_t>(a.experts_per_token) : 0};
}

// The feed-forward's saved tensors besides h2 and rstd2: the dense g, u, s;
// or a mixture of experts' (model/moe_feed_forward.h) router probabilities,
// choices and weights, its routes' order and rows, and per route the
// dispatched row, the experts' g, u, s (F is then their width) and outputs.
size_t feed_forward_bytes(const Dims& d) {
  if (d.E == 0) return d.M * d.e * 3 * d.F;
  const size_t k = d.R / d.M;
  return d.M * d.E * 4 /* probs */ + d.M * k * (4 + 4) /* experts, weights */ + d.R * (4 + 4) /* order, rows */ +
         d.R * d.e * (2 * d.D /* xe, ye */ + 3 * d.F /* g, u, s */);
}

// Everything block_forward produces, in bytes (BlockSaved with no policy applied, x included).
size_t block_all_bytes(const Dims& d) {
  return d.M * d.e * (3 * d.D /* x, h1, x2 */ + d.D /* h2 */ + 2 * d.Dq /* q, o */ + 2 * d.Dkv /* k, v */) +
         feed_forward_bytes(d) + 2 * d.M * 4 /* rstd1, rstd2 */ + d.lse +
         (d.heads > 0 ? d.M * d.e * (d.Dq + d.Dkv) /* q_raw, k_raw */ + d.M * d.heads * 4 /* rstd_q, rstd_k */ : 0);
}

}  // namespace

size_t block_saved_bytes(const ModelArgs& args, const TrainShape& shape, int layer) {
  const Dims d = dims_of(args, shape);
  if (shape.ac.recomputes_whole_block(layer)) return d.M * d.D * d.e;  // the input only
  if (shape.ac.mode == AcMode::selective_op)  // drops h1, rstd1, h2, rstd2, s (per route under MoE)
    return block_all_bytes(d) - d.M * d.e * 2 * d.D - (d.E ? d.R : d.M) * d.e * d.F - 2 * d.M * 4;
  return block_all_bytes(d);
}

MemoryEstimate estimate_memory(const ModelArgs& args, const TrainShape& shape) {
  // A dry run (core/dry_run.h) of what one process's step holds: the model
  // with its weights, the step's token batches, one micro-batch's forward
  // and backward (which create the gradients) on the configured number of
  // threads, and AdamW's two fp32 moments of every weight.
  const int threads_before = num_threads();
  if (shape.threads > 0) set_num_threads(shape.threads);
  MemoryEstimate est;
  {
    DryRun dry;
    TrackingAllocator& alloc = dry.allocator();
    // As the trainer holds a process's whole model: bf16 weights cast per block.
    Llama model(args, shape.compute_dtype, shape.seq_len, LlamaOptions{.compute_copy = ComputeCopy::per_group});
    if (model.moe_state()) model.set_step_sequences(shape.local_batch_size);
    std::vector<Tensor> batches;
    for (int64_t i = 0; i < std::max<int64_t>(1, shape.micro_batches); ++i)
      for (const char* tag : {"batch.tokens", "batch.targets"})
        batches.push_back(
            Tensor::empty({shape.local_batch_size, shape.seq_len}, DType::i32, MemCategory::workspace, tag));
    // The workspace's peak leaves out oneDNN's scratchpad (grown per thread
    // to the largest product run): its size is the kernel's own choice.
    size_t workspace = alloc.live_bytes(MemCategory::workspace), peak_workspace = workspace;
    alloc.set_timeline(true);
    model.forward_backward(batches[0], batches[1], 1.0f, shape.ac);
    alloc.set_timeline(false);
    for (const MemEvent& e : alloc.timeline()) {
      if (e.category != MemCategory::workspace) continue;
      if (e.tag == "gemm.scratchpad") continue;
      workspace = e.is_alloc ? workspace + e.bytes : workspace - e.bytes;
      peak_workspace = std::max(peak_workspace, workspace);
    }
    est.peak = alloc.stats().peak;
    est.peak[static_cast<int>(MemCategory::workspace)] = peak_workspace;
  }
  set_num_threads(threads_before);
  const size_t P = static_cast<size_t>(padded_numel(llama_param_specs(args)));
  est.peak[static_cast<int>(MemCategory::optimizer_state)] = 2 * P * 4;
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
