#include "anvil/estimate/gpu_estimate.h"

#include <algorithm>
#include <cmath>

#include "anvil/core/error.h"
#include "anvil/estimate/flops.h"
#include "anvil/pipeline/schedule.h"
#include "anvil/pipeline/split.h"

namespace anvil {

namespace {

constexpr double kBf16 = 2;  // bytes of a bf16 value (parameters as computed, activations, logits in v0_1_0)
constexpr double kF32 = 4;   // bytes of an fp32 value (master weights, AdamW state, reduced gradients)

// AdamW (torch.optim, foreach) per fp32 parameter shard, bytes of HBM traffic:
// lerp_(m, g) 12, mul_(v) 8, addcmul_(v, g, g) 12, sqrt(v) 8, div_ 8, add_(eps)
// 8, addcdiv_(p, m, denom) 16, weight decay mul_(p) 8; gradient clipping reads
// each gradient for the norm (4) and scales it (8).
constexpr double kOptimizerBytesPerParam = 80 + 12;

// What one pipeline stage holds (pp == 1: the whole model).
struct StageShape {
  int64_t first_layer = 0, layers = 0;
  bool embedding = false, head = false;
};

// torchtitan's split (distributed/pipeline.py generate_split_points) is
// Anvil's default cut (pipeline/split.h): the embedding and the head count as
// one layer each and the num_layers + 2 units spread evenly over the stages,
// the remainder going to the earliest ones.
std::vector<StageShape> split_stages(const ModelArgs& args, int64_t pp) {
  const int n = static_cast<int>(args.n_layers);
  if (pp == 1) return {{0, n, true, true}};
  const PipelineSplit split{static_cast<int>(pp), 1, 1};
  std::vector<StageShape> out;
  for (int s = 0; s < split.stages; ++s) {
    const auto [first, end] = pipeline_stage_modules(args, split, s);      // modules: 0 the embedding, n + 1 the head
    const int b0 = std::max(first, 1) - 1, b1 = std::min(end, n + 1) - 1;  // blocks [b0, b1)
    out.push_back({b0, b1 - b0, first == 0, end == n + 2});
  }
  return out;
}

// Model dimensions per GPU under tensor parallelism t.
struct Dims {
  double D, Dq, Dkv, F, H, V, t;
};

// Bytes per token one block keeps for its backward under torchtitan's eager
// Llama (flash SDPA, fused or composite RMSNorm, RoPE in fp32 cast back to
// bf16, repeat_kv materialising GQA's keys and values), by AC treatment:
//   none: x, h1, x2, h2 (norm inputs and outputs; under sequence parallel the
//     residual stream is sharded and the norm outputs are gathered), q, the
//     repeated k and v, SDPA's output and its contiguous transpose (5·Dq),
//     w1 and w3 outputs, silu(w1), their product (4·F), fp32 log-sum-exp per
//     head, two fp32 rstd;
//   selective op: torchtitan's policy saves the outputs of mm (all but every
//     second one: wq, wv, w1, w2 of the seven) and of SDPA, plus the block's
//     input; the rest is recomputed;
//   full (and the checkpointed layers of selective layer): the input.
enum class BlockAc { none, op, full };
double saved_per_token(const Dims& d, BlockAc ac) {
  switch (ac) {
    case BlockAc::none:
      return kBf16 * (2 * d.D / d.t + 2 * d.D + 5 * d.Dq / d.t + 4 * d.F / d.t) + kF32 * d.H / d.t + 2 * kF32;
    case BlockAc::op:
      return kBf16 * (d.D / d.t + d.Dq / d.t + d.Dkv / d.t + d.Dq / d.t + d.F / d.t + d.D) + kF32 * d.H / d.t;
    case BlockAc::full:
      return kBf16 * d.D / d.t;
  }
  return 0;
}

// `index` counts the blocks of this process's stage from 0: torchtitan's
// selective-layer counter (ptd_checkpoint_wrapper._count) is per process, and
// wraps block number c (counted from 1) when c % k == 0.
BlockAc block_ac(const AcPolicy& ac, int64_t index) {
  switch (ac.mode) {
    case AcMode::none:
      return BlockAc::none;
    case AcMode::selective_op:
      return BlockAc::op;
    case AcMode::full:
      return BlockAc::full;
    case AcMode::selective_layer:
      return (index + 1) % ac.every == 0 ? BlockAc::full : BlockAc::none;
  }
  return BlockAc::none;
}

// Gradients alive at once inside a block's backward beyond the recomputed
// tensors: three of the FFN's hidden width and two of the model width.
double backward_temps_per_token(const Dims& d) { return kBf16 * (3 * d.F / d.t + 2 * d.D); }

// Element-wise (memory-bound) HBM bytes per token of one block's forward in
// eager mode: two RMSNorms (read x, write y), RoPE on q and k in fp32 (cast
// up, complex multiply, cast down: 20 bytes per element), repeat_kv's copies
// (GQA only), the transpose back to contiguous, two residual adds, silu and
// the SwiGLU product. The backward moves about twice as much (each op reads
// the incoming gradient and its saved inputs and writes one gradient).
double elementwise_fwd_bytes_per_token(const Dims& d, bool gqa) {
  const double norms = 2 * 2 * kBf16 * d.D / d.t;
  const double rope = 20 * (d.Dq + d.Dkv) / d.t;
  const double repeat = gqa ? 2 * kBf16 * (d.Dkv + d.Dq) / d.t : 0;
  const double transpose = 2 * kBf16 * d.Dq / d.t;
  const double residual = 2 * 3 * kBf16 * d.D / d.t;
  const double swiglu = (2 + 3) * kBf16 * d.F / d.t;
  return norms + rope + repeat + transpose + residual + swiglu;
}

// Cross-entropy over fp32 logits, HBM bytes per logit: the cast to fp32 (read
// 2, write 4), log_softmax (read 4, write 4); backward: nll's zero-filled
// gradient (4), log_softmax's backward (read 8, write 4), the cast back (read 4,
// write 2).
constexpr double kLossBytesPerLogit = 6 + 8 + 4 + 12 + 6;

struct Roofline {
  double peak, bw, attn_eff;
  double gemm(double M, double K, double N) const {
    return std::max(2 * M * K * N / peak, kBf16 * (M * K + K * N + M * N) / bw);
  }
  double mem(double bytes) const { return bytes / bw; }
};

// Ring collective bus bandwidth of a group of n GPUs whose members are
// `stride` ranks apart (torchtitan's mesh is pp × dp_replicate × dp_shard × tp,
// tp innermost, ranks filling nodes in order): NVLink inside a node; across
// nodes each node's members send through their own NICs in parallel (NCCL
// runs one ring per NIC), so the ring moves internode × members-per-node,
// capped by NVLink.
double bus_bandwidth(const GpuHardware& hw, int64_t n, int64_t stride) {
  const int64_t gpn = hw.gpus_per_node;
  const int64_t per_node = stride >= gpn ? 1 : std::min<int64_t>(n, gpn / stride);
  if (n <= per_node) return hw.nvlink_bandwidth;
  return std::min(hw.nvlink_bandwidth, hw.internode_bandwidth * static_cast<double>(per_node));
}

// All-gather or reduce-scatter of `bytes` (the unsharded size) over n ranks.
double ring_seconds(double bytes, int64_t n, double busbw) {
  return n <= 1 ? 0 : bytes * static_cast<double>(n - 1) / static_cast<double>(n) / busbw;
}

struct Candidate {
  double total = 0;
  GpuStageMemory parts;  // the categories that make it up
};

}  // namespace

double torchtitan_flops_per_token(const ModelArgs& a, int64_t seq_len, TorchtitanEra era) {
  if (era == TorchtitanEra::v0_1_0) return flops_per_token(a, seq_len);
  return 6.0 * static_cast<double>(a.num_params()) +
         12.0 * static_cast<double>(a.n_layers * a.n_heads * a.head_dim() * seq_len);
}

namespace {

// The spec's checks, in its keys' words.
void check_gpu_run(const GpuRunSpec& sp) {
  const ModelArgs& a = sp.model;
  ANVIL_CHECK(sp.dp_replicate >= 1 && sp.dp_shard >= 1 && sp.cp >= 1 && sp.tp >= 1 && sp.pp >= 1,
              "parallel degrees must be positive");
  ANVIL_CHECK(sp.dp_shard * sp.cp >= 2, "parallelism.data_parallel_shard_degree x context_parallel_degree is ",
              sp.dp_shard * sp.cp,
              ": the GPU planner models FSDP2 with bf16 compute, and torchtitan without FSDP trains in fp32; "
              "use a shard degree of 2 or more");
  ANVIL_CHECK(sp.cp == 1 || sp.seq_len % (2 * sp.cp) == 0, "context parallelism cuts every sequence into 2 x ", sp.cp,
              " chunks, which must divide training.seq_len ", sp.seq_len);
  ANVIL_CHECK(a.n_heads % sp.tp == 0 && a.n_kv_heads % sp.tp == 0, "parallelism.tensor_parallel_degree ", sp.tp,
              " does not divide ", a.name, "/", a.flavor, "'s ", a.n_heads, " heads and ", a.n_kv_heads, " KV heads");
  ANVIL_CHECK(sp.seq_len >= 1 && sp.local_batch >= 1,
              "training.seq_len and training.local_batch_size must be positive");
  ANVIL_CHECK(!a.tie_embeddings || sp.pp == 1, a.name, "/", a.flavor,
              " ties its embedding to its head, which pipeline stages cannot share");
  if (sp.pp > 1) {
    ANVIL_CHECK(sp.microbatch_size >= 1 && sp.local_batch % sp.microbatch_size == 0, "training.local_batch_size ",
                sp.local_batch, " is not a multiple of ", "parallelism.pipeline_parallel_microbatch_size ",
                sp.microbatch_size);
    ANVIL_CHECK(sp.pp_schedule == "1F1B" || sp.pp_schedule == "GPipe", "parallelism.pipeline_parallel_schedule ",
                sp.pp_schedule, ": the GPU planner models GPipe and 1F1B (one stage per rank)");
  }
}

// What every stage's memory and time derive from: the run's dimensions per
// GPU, its parameter counts per group, the roofline and the links.
struct RunTerms {
  const GpuRunSpec& sp;
  Dims d;
  bool gqa, v010;
  int64_t m;  // micro-batches per step (pipeline), 1 otherwise
  double t, c, N, s, T,
      Vt;  // tp, cp, shards (dp_shard · cp), seq_len, tokens per micro-batch per GPU, vocabulary per GPU
  double layer_params, emb_params, head_params;
  Roofline rf;
  double bw_shard, bw_rep, bw_tp, bw_cp, bw_pp;
};

RunTerms run_terms(const GpuRunSpec& sp, const GpuHardware& hw) {
  const ModelArgs& a = sp.model;
  const double t = static_cast<double>(sp.tp);
  const Dims d{static_cast<double>(a.dim),
               static_cast<double>(a.n_heads * a.head_dim()),
               static_cast<double>(a.n_kv_heads * a.head_dim()),
               static_cast<double>(a.ffn_hidden_dim()),
               static_cast<double>(a.n_heads),
               static_cast<double>(a.vocab_size),
               t};
  const double s = static_cast<double>(sp.seq_len);
  // torchtitan's mesh: pp × dp_replicate × dp_shard × cp × tp, tp innermost.
  const int64_t pp_stride = sp.dp_replicate * sp.dp_shard * sp.cp * sp.tp;
  return RunTerms{
      sp,
      d,
      a.n_kv_heads < a.n_heads,
      sp.era == TorchtitanEra::v0_1_0,
      sp.micro_batches(),
      t,
      static_cast<double>(sp.cp),
      static_cast<double>(sp.dp_shard * sp.cp),
      s,
      static_cast<double>(sp.pp > 1 ? sp.microbatch_size : sp.local_batch) * s / static_cast<double>(sp.cp),
      d.V / t,
      // Parameters per GPU (after TP): the block's matrices are split, its norms replicated.
      static_cast<double>(a.params_per_layer() - 2 * a.dim) / t + 2 * d.D,
      d.D * (d.V / t),
      d.D * (d.V / t) + d.D,
      Roofline{hw.peak_bf16_flops, hw.hbm_bandwidth, hw.attention_efficiency},
      bus_bandwidth(hw, sp.dp_shard * sp.cp, sp.tp),
      bus_bandwidth(hw, sp.dp_replicate, sp.tp * sp.cp * sp.dp_shard),
      bus_bandwidth(hw, sp.tp, 1),
      bus_bandwidth(hw, sp.cp, sp.tp),
      pp_stride < hw.gpus_per_node ? hw.nvlink_bandwidth : hw.internode_bandwidth,
  };
}

// A stage's parameter counts: its root group (embedding, final norm, head) and all of them.
struct StageParams {
  double root, psi;
};
StageParams stage_params(const RunTerms& r, const StageShape& st) {
  const double root = (st.embedding ? r.emb_params : 0) + (st.head ? r.head_params : 0);
  return {root, static_cast<double>(st.layers) * r.layer_params + root};
}

// Context parallelism's buffers in a block's backward: the whole sequences'
// keys and values gathered (bf16; torchtitan repeats GQA's KV heads before
// SDPA, so Dq wide) and their gradients accumulated in fp32 before the
// reduce-scatter (PyTorch's templated ring attention).
// Elements of the whole sequences' K and V a GPU's micro-batch gathers per layer (0 without CP).
double cp_kv_elements(const RunTerms& r) { return r.sp.cp == 1 ? 0 : 2 * r.T * r.c * r.d.Dq / r.t; }
double cp_kv_bytes(const RunTerms& r) { return (kBf16 + kF32) * cp_kv_elements(r); }

// A stage's memory, by category, at its fullest moment (the candidate
// moments' largest), and what the caching allocator reserves for it.
GpuStageMemory stage_memory(const RunTerms& r, const StageShape& st, int stage, int in_flight) {
  const GpuRunSpec& sp = r.sp;
  const Dims& d = r.d;
  const double t = r.t, N = r.N, T = r.T, m = static_cast<double>(r.m);
  const auto [root, psi] = stage_params(r, st);
  GpuStageMemory mem;
  mem.stage = stage;
  mem.layers = st.layers;
  mem.has_embedding = st.embedding;
  mem.has_head = st.head;
  mem.in_flight = in_flight;
  mem.parameters = kF32 * psi / N;
  mem.optimizer = 2 * kF32 * psi / N;
  mem.gradients = kF32 * psi / N;
  // The all-gather stream's pool: at most two all-gathers in flight (FSDP2),
  // so the two largest groups' flat bf16 buffers stay cached.
  std::vector<double> groups(static_cast<size_t>(st.layers), r.layer_params);
  if (root > 0) groups.push_back(root);
  std::sort(groups.rbegin(), groups.rend());
  const double largest_group = groups.empty() ? 0 : groups[0];
  mem.allgather_pool = kBf16 * (largest_group + (groups.size() > 1 ? groups[1] : 0));
  mem.reduce_pool_extra = r.v010 ? 0 : kF32 * largest_group;

  // Activations of one micro-batch on this stage, and the largest block transient.
  double acts = 0, block_transient = 0;
  for (int64_t l = st.first_layer; l < st.first_layer + st.layers; ++l) {
    const BlockAc ac = block_ac(sp.ac, l - st.first_layer);
    acts += saved_per_token(d, ac) * T;
    const double recomputed = (saved_per_token(d, BlockAc::none) - saved_per_token(d, ac)) * T;
    double transient = recomputed + backward_temps_per_token(d) * T + kBf16 * r.layer_params + cp_kv_bytes(r);
    if (sp.pp == 1 && r.v010)  // the block's bf16 gradients and the fp32 reduce-scatter input it copies them into
      transient = std::max(transient, (kBf16 + kF32) * r.layer_params);
    block_transient = std::max(block_transient, transient);
  }
  if (st.head) acts += 2 * kBf16 * d.D / t * T;  // the final norm's input and output

  const double pp_buffer_each = kBf16 * T * d.D / t;
  mem.pp_buffers = sp.pp > 1 ? pp_buffer_each * m * ((st.embedding ? 0 : 1) + (st.head ? 0 : 1)) : 0;
  const double logits = T * r.Vt;  // per micro-batch
  const double out_elem = r.v010 ? kBf16 : kF32;
  const bool keep = sp.keep_pp_outputs && sp.pp > 1 && st.head;
  const double kept_all = keep ? out_elem * logits * m : 0;

  double gathered = 0, accum = 0, root_grads = 0;
  if (sp.pp > 1) {
    // Under PP torchtitan keeps every group gathered (reshard_after_forward
    // False) and PyTorch's stage runs backward with gradient sync off, so
    // FSDP accumulates unsharded fp32 gradients until the last micro-batch.
    gathered = kBf16 * psi;
    accum = kF32 * psi;
  } else {
    // The root group (embedding, final norm, output) stays gathered from
    // forward to backward (FSDP2's root is not resharded after forward); a
    // block is gathered while it runs and the next one is prefetched.
    gathered = kBf16 * (root + 2 * (st.layers > 0 ? r.layer_params : 0));
    root_grads = kBf16 * root;  // the root's bf16 gradients live from the head's backward to the end
  }
  const double base = mem.parameters + mem.optimizer + gathered + accum + mem.pp_buffers;
  const double inflight_acts = acts * static_cast<double>(in_flight);

  std::vector<Candidate> cands;
  {
    Candidate c;  // a block's backward with the stage's in-flight micro-batches alive
    c.parts.activations = inflight_acts;
    c.parts.working = block_transient + root_grads;
    c.parts.kept_outputs = kept_all;
    c.parts.peak_at = "block backward";
    c.total = base + inflight_acts + block_transient + root_grads + kept_all;
    cands.push_back(c);
  }
  if (st.head) {
    // The loss's backward: log_softmax's fp32 output (saved), nll's fp32
    // gradient and log_softmax's fp32 gradient, plus the model output while
    // something holds it: the pipeline stage's cache (its bf16 output) in
    // v0_1_0 with PP, train.py's `pred` (fp32) in apr2024.
    double per_logit = 3 * kF32;
    if (!r.v010)
      per_logit += kF32;
    else if (sp.pp > 1)
      per_logit += kBf16;
    Candidate c;
    c.parts.activations = inflight_acts;
    c.parts.loss_buffers = per_logit * logits;
    // The current micro-batch's output is in the loss buffers; the others are kept.
    c.parts.kept_outputs = keep ? out_elem * logits * (m - 1) : 0;
    c.parts.peak_at = "loss backward";
    c.total = base + inflight_acts + c.parts.loss_buffers + c.parts.kept_outputs;
    cands.push_back(c);
  }
  if (sp.pp > 1 && r.v010) {
    // After the last backward every group reduce-scatters: the first input
    // joins the still-gathered weights and the accumulators.
    Candidate c;
    c.parts.working = kF32 * largest_group;
    c.parts.kept_outputs = kept_all;
    c.parts.peak_at = "end-of-step reduce-scatter";
    c.total = base + c.parts.working + kept_all;
    cands.push_back(c);
  }
  if (sp.pp == 1 && r.v010 && root > 0) {
    Candidate c;  // the root group's reduce-scatter, last in the backward
    c.parts.working = (kBf16 + kF32) * root;
    c.parts.peak_at = "root reduce-scatter";
    c.total = mem.parameters + mem.optimizer + kBf16 * root + c.parts.working;
    cands.push_back(c);
  }
  {
    Candidate c;  // AdamW's step: sqrt(exp_avg_sq) is one fp32 temporary the size of the shards
    c.parts.working = kF32 * psi / N;
    c.parts.kept_outputs = kept_all;
    c.parts.peak_at = "optimizer step";
    c.total = mem.parameters + mem.optimizer + mem.pp_buffers + c.parts.working + kept_all;
    cands.push_back(c);
  }
  const auto best = std::max_element(cands.begin(), cands.end(),
                                     [](const Candidate& x, const Candidate& y) { return x.total < y.total; });
  double compute_reserved = best->total;
  // Seed 000's end of step: torch.cat of the kept outputs, alive beside them.
  // The caching allocator cuts it from a cached block when one is large
  // enough; otherwise it maps a new segment on top of what it already holds.
  if (keep) {
    mem.merged_outputs = kept_all;
    // The largest single blocks freed earlier in the step: the loss's fp32
    // buffers, the reduce-scatter input of the largest group (compute stream
    // in v0_1_0) and the fp32 accumulator of the largest weight (the head's).
    const double largest_cached = std::max({kF32 * logits, r.v010 ? kF32 * largest_group : 0.0, kF32 * d.D * r.Vt});
    const double merge_moment = mem.parameters + mem.optimizer + mem.pp_buffers + 2 * kept_all;
    if (kept_all > largest_cached) compute_reserved += kept_all;
    compute_reserved = std::max(compute_reserved, merge_moment);
  }
  mem.gathered_params = gathered;
  mem.grad_accumulators = accum;
  mem.activations = best->parts.activations;
  mem.working = best->parts.working;
  mem.loss_buffers = best->parts.loss_buffers;
  mem.kept_outputs = best->parts.kept_outputs;
  mem.peak_at = best->parts.peak_at;
  if (best->parts.peak_at == "optimizer step" || best->parts.peak_at == "end-of-step reduce-scatter") {
    mem.gathered_params = best->parts.peak_at == "optimizer step" ? 0 : gathered;
    mem.grad_accumulators = best->parts.peak_at == "optimizer step" ? 0 : accum;
  }
  // Gradients (the reduce-scatter outputs) are allocated on the
  // reduce-scatter stream; in the previous step's optimizer they were alive
  // and their blocks stay cached in that pool.
  mem.peak_allocated = best->total + (mem.peak_at == "optimizer step" ? mem.gradients : 0);
  mem.reserved = compute_reserved + mem.gradients + mem.reduce_pool_extra + mem.allgather_pool;
  return mem;
}

// One micro-batch's time on a stage (compute, tensor-parallel collectives,
// FSDP's copies) and the step's FSDP traffic and optimizer time.
struct StageTime {
  double fwd = 0, bwd = 0, tp_fwd = 0, tp_bwd = 0, cp_fwd = 0, cp_bwd = 0;
  double fsdp_mem = 0, optimizer = 0;
  double rs = 0, ar = 0, fsdp_comm = 0, first_group_ag = 0;
  double p2p = 0;  // the boundary tensor sent on, or its gradient back
};

StageTime stage_time(const RunTerms& r, const StageShape& st) {
  const GpuRunSpec& sp = r.sp;
  const Dims& d = r.d;
  const Roofline& rf = r.rf;
  const double t = r.t, T = r.T, N = r.N, m = static_cast<double>(r.m);
  const auto [root, psi] = stage_params(r, st);
  StageTime out;
  // 4·T·s·Dq, halved by the causal mask; under CP T is the rank's share of
  // the queries over the whole sequence's keys (head-tail: an equal share of the work).
  const double attn_fwd_flops = 2 * T * r.s * d.Dq / t;
  // CP per layer: the forward all-gathers the whole sequences' keys and
  // values (bf16, Dq wide), the backward gathers them again and
  // reduce-scatters their fp32 gradients.
  const double cp_kv = cp_kv_elements(r);
  const double cp_gather = sp.cp > 1 ? ring_seconds(kBf16 * cp_kv, sp.cp, r.bw_cp) : 0;
  const double cp_scatter = sp.cp > 1 ? ring_seconds(kF32 * cp_kv, sp.cp, r.bw_cp) : 0;
  const double ew_fwd = rf.mem(elementwise_fwd_bytes_per_token(d, r.gqa) * T);
  const double tp_coll = sp.tp > 1 ? ring_seconds(kBf16 * T * d.D, sp.tp, r.bw_tp) : 0;
  for (int64_t l = st.first_layer; l < st.first_layer + st.layers; ++l) {
    const double wq = rf.gemm(T, d.D, d.Dq / t), wkv = rf.gemm(T, d.D, d.Dkv / t), wo = rf.gemm(T, d.Dq / t, d.D);
    const double w13 = rf.gemm(T, d.D, d.F / t), w2 = rf.gemm(T, d.F / t, d.D);
    const double gemms = wq + 2 * wkv + wo + 2 * w13 + w2;
    const double attn = attn_fwd_flops / (rf.peak * rf.attn_eff);
    out.fwd += gemms + attn + ew_fwd;
    out.bwd += 2 * gemms + 2.5 * attn + 2 * ew_fwd;  // dX and dW per GEMM; FlashAttention's backward is 2.5 forwards
    out.tp_fwd += 4 * tp_coll;  // sequence parallel: all-gather and reduce-scatter around both halves
    out.tp_bwd += 4 * tp_coll;
    out.cp_fwd += cp_gather;
    out.cp_bwd += cp_gather + cp_scatter;
    switch (block_ac(sp.ac, l - st.first_layer)) {
      case BlockAc::none:
        break;
      case BlockAc::op:
        out.bwd += wkv + wo + w13 + ew_fwd;
        out.tp_bwd += 2 * tp_coll;
        break;  // every second mm
      case BlockAc::full:
        out.bwd += gemms + attn + ew_fwd;
        out.tp_bwd += 4 * tp_coll;
        out.cp_bwd += cp_gather;
        break;
    }
  }
  if (st.embedding) {
    out.fwd += rf.mem(2 * kBf16 * T * d.D / t);
    out.bwd += rf.mem(2 * kBf16 * d.V * d.D / t + kBf16 * T * d.D / t);  // a dense gradient of the table
  }
  if (st.head) {
    const double logits = T * r.Vt;
    const double out_proj = rf.gemm(T, d.D, r.Vt);
    out.fwd += out_proj + rf.mem(2 * kBf16 * T * d.D / t);
    out.bwd += 2 * out_proj + rf.mem(kLossBytesPerLogit * logits + 4 * kBf16 * T * d.D / t);
  }
  // FSDP's copies: all-gather copy-out (read and write bf16), reduce-scatter copy-in.
  const double gathers = sp.pp > 1 ? 1 : 2;
  out.fsdp_mem = rf.mem(
      gathers * 2 * kBf16 * psi +
      (sp.pp > 1 ? (kBf16 + kF32) * psi + (kBf16 + 2 * kF32) * psi * (m - 1) + 2 * kF32 * psi : (kBf16 + kF32) * psi));
  out.optimizer = rf.mem(kOptimizerBytesPerParam * psi / N);
  // FSDP traffic per step: gathers of bf16 weights (forward, and again in
  // backward after resharding, except the root and the last block), a
  // reduce-scatter of fp32 gradients, HSDP's all-reduce of the shards.
  const double ag_bytes = kBf16 * (sp.pp > 1 ? psi : psi + (psi - root - (st.layers > 0 ? r.layer_params : 0)));
  out.rs = ring_seconds(kF32 * psi, sp.dp_shard, r.bw_shard);
  out.ar = 2 * ring_seconds(kF32 * psi / N, sp.dp_replicate, r.bw_rep);
  out.fsdp_comm = ring_seconds(ag_bytes, sp.dp_shard, r.bw_shard) + out.rs + out.ar;
  out.first_group_ag =
      ring_seconds(kBf16 * (st.embedding && root > 0 ? root : r.layer_params), sp.dp_shard, r.bw_shard);
  out.p2p = kBf16 * T * d.D / t / r.bw_pp;
  return out;
}

// Without pipeline parallelism: the one stage's step, FSDP's collectives
// beside compute except the first all-gather (nothing to hide it) and the
// root's reduce-scatter and all-reduce (the backward's last).
void single_stage_step(const RunTerms& r, const StageShape& st, const StageTime& time, GpuStepEstimate& out) {
  const GpuRunSpec& sp = r.sp;
  const double root = stage_params(r, st).root;
  const double compute = time.fwd + time.bwd + time.fsdp_mem;
  const double tp_comm = time.tp_fwd + time.tp_bwd, cp_comm = time.cp_fwd + time.cp_bwd;
  const double last_rs = ring_seconds(kF32 * root, sp.dp_shard, r.bw_shard) +
                         2 * ring_seconds(kF32 * root / r.N, sp.dp_replicate, r.bw_rep);
  const double exposed = time.first_group_ag + last_rs;
  const double hidden = std::max(0.0, time.fsdp_comm - exposed);
  const double body = std::max(compute + tp_comm + cp_comm, hidden);
  out.compute_seconds = compute;
  out.fsdp_comm_seconds = time.fsdp_comm;
  out.exposed_comm_seconds = exposed + std::max(0.0, hidden - (compute + tp_comm + cp_comm));
  out.optimizer_seconds = time.optimizer;
  out.tp_comm_seconds = tp_comm;
  out.cp_comm_seconds = cp_comm;
  out.step_seconds = time.first_group_ag + body + last_rs + time.optimizer;
}

// With pipeline parallelism: the schedule simulated with every stage's
// F, I and W times; the gradients are reduced only after the last
// micro-batch (nothing left to overlap), then the optimizer steps.
void pipeline_step(const RunTerms& r, const std::vector<StageShape>& shapes, const std::vector<StageTime>& times,
                   const PipeSchedule& schedule, GpuStepEstimate& out) {
  const double m = static_cast<double>(r.m);
  std::vector<PipeCosts> stage_costs;
  double worst_stage_tail = 0, first_gather = 0, tp_comm = 0, cp_comm = 0;
  for (size_t si = 0; si < shapes.size(); ++si) {
    const StageShape& st = shapes[si];
    const StageTime& time = times[si];
    const double f = time.fwd + time.tp_fwd + time.cp_fwd + (st.head ? 0 : time.p2p) + time.fsdp_mem / (2 * m);
    const double b = time.bwd + time.tp_bwd + time.cp_bwd + (st.embedding ? 0 : time.p2p) + time.fsdp_mem / (2 * m);
    stage_costs.push_back(PipeCosts{f, b / 2, b / 2});
    tp_comm = std::max(tp_comm, (time.tp_fwd + time.tp_bwd) * m);
    cp_comm = std::max(cp_comm, (time.cp_fwd + time.cp_bwd) * m);
    worst_stage_tail = std::max(worst_stage_tail, time.rs + time.ar + time.optimizer);
    first_gather = std::max(first_gather, time.first_group_ag);
    out.fsdp_comm_seconds = std::max(out.fsdp_comm_seconds, time.fsdp_comm);
    out.optimizer_seconds = std::max(out.optimizer_seconds, time.optimizer);
    out.compute_seconds = std::max(out.compute_seconds, (f + b) * m);
  }
  const PipeTimeline tl = simulate_pipeline_schedule(schedule, stage_costs);
  double busiest = 0;
  for (double b : tl.busy) busiest = std::max(busiest, b);
  out.bubble_fraction = 1 - busiest / tl.makespan;
  out.tp_comm_seconds = tp_comm;
  out.cp_comm_seconds = cp_comm;
  out.exposed_comm_seconds = first_gather + worst_stage_tail - out.optimizer_seconds;
  out.step_seconds = first_gather + tl.makespan + worst_stage_tail;
}

}  // namespace

GpuStepEstimate estimate_gpu_run(const GpuRunSpec& sp, const GpuHardware& hw) {
  check_gpu_run(sp);
  const RunTerms r = run_terms(sp, hw);
  const std::vector<StageShape> shapes = split_stages(sp.model, sp.pp);
  std::vector<int> in_flight(shapes.size(), 1);
  PipeSchedule schedule;
  if (sp.pp > 1) {
    schedule = make_pipeline_schedule(sp.pp_schedule, static_cast<int>(sp.pp), 1, static_cast<int>(r.m));
    in_flight = stage_in_flight(schedule);
  }
  GpuStepEstimate out;
  std::vector<StageTime> times;
  for (size_t si = 0; si < shapes.size(); ++si) {
    out.stages.push_back(stage_memory(r, shapes[si], static_cast<int>(si), in_flight[si]));
    out.max_reserved = std::max(out.max_reserved, out.stages.back().reserved);
    times.push_back(stage_time(r, shapes[si]));
  }
  if (sp.pp == 1)
    single_stage_step(r, shapes[0], times[0], out);
  else
    pipeline_step(r, shapes, times, schedule, out);

  const double local_tokens = static_cast<double>(sp.local_batch) * r.s;
  out.tokens_per_second_per_gpu = local_tokens / out.step_seconds / static_cast<double>(sp.cp * sp.tp * sp.pp);
  out.flops_per_token = torchtitan_flops_per_token(sp.model, sp.seq_len, sp.era);
  out.mfu = out.flops_per_token * out.tokens_per_second_per_gpu / hw.peak_bf16_flops;
  out.fits = out.max_reserved <= hw.hbm_bytes;
  return out;
}

}  // namespace anvil
