#include "anvil/estimate/gpu_estimate.h"

#include <algorithm>
#include <cmath>
#include <set>
#include <tuple>

#include "anvil/core/error.h"
#include "anvil/estimate/flops.h"
#include "anvil/estimate/gpu_calibration.h"
#include "anvil/pipeline/schedule.h"
#include "anvil/pipeline/split.h"

namespace anvil {

namespace {

constexpr double kBf16 = 2;  // bytes of a bf16 value (parameters as computed, activations, logits in v0_1_0)
constexpr double kF32 = 4;   // bytes of an fp32 value (master weights, AdamW state, reduced gradients)

// AdamW per fp32 parameter shard, bytes of HBM traffic, and gradient
// clipping's (read each gradient for the norm, 4, and scale it, 8).
// torch.optim's foreach AdamW (torchtitan in April 2024): lerp_(m, g) 12,
// mul_(v) 8, addcmul_(v, g, g) 12, sqrt(v) 8, div_ 8, add_(eps) 8,
// addcdiv_(p, m, denom) 16, weight decay mul_(p) 8. The fused AdamW
// (optimizer.implementation = "fused", torchtitan's default since) reads p,
// g, m and v and writes p, m and v once: 28.
constexpr double kForeachAdamwBytesPerParam = 80 + 12;
constexpr double kFusedAdamwBytesPerParam = 28 + 12;
// Muon per fp32 element of a matrix's shard, bytes of HBM traffic beside
// Newton-Schulz: the momentum (read g and m, write m and u: 16), u into the
// gather's send buffer and the owner's runs out of its receive buffer into
// the whole matrix (8 + 8, the scatter the same again: 32), the update (read
// p and o, write p: 12), and clipping's 12.
constexpr double kMuonBytesPerParam = 16 + 32 + 12 + 12;

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

// Model dimensions per GPU under tensor parallelism t; a mixture of experts'
// E experts of width Fe, k of them per token (moe false: a dense FFN of width F).
struct Dims {
  double D, Dq, Dkv, F, H, V, t;
  bool moe = false;
  double E = 0, k = 0, Fe = 0;
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
// A mixture of experts (torchtitan's MoE, models/moe/moe.py, as its Qwen3
// flavours configure it: scores applied after the experts) keeps instead of
// the FFN's four F-wide tensors: the softmax's fp32 scores (E), the grouped
// products' input (k·D), the experts' w1 and w3 outputs, silu and product
// (4·k·Fe), the fp32 copy of the routed outputs the combining bmm saves (k·D)
// and int64 indices and fp32 top scores (about 32 bytes per route). Selective
// op saves the router's gate output, the fifth mm of the block (wq, wv, gate
// saved; wk, wo recomputed); torchtitan's Qwen3 list does not save the
// grouped products or the all-to-all, so both are recomputed.
enum class BlockAc { none, op, full };
double ffn_saved_per_token(const Dims& d, BlockAc ac) {
  if (d.moe) {
    switch (ac) {
      case BlockAc::none:
        return kBf16 * (d.k * d.D + 4 * d.k * d.Fe) + kF32 * (d.k * d.D + d.E) + 32 * d.k;
      case BlockAc::op:
        return kBf16 * d.E;
      case BlockAc::full:
        return 0;
    }
  }
  switch (ac) {
    case BlockAc::none:
      return kBf16 * 4 * d.F / d.t;
    case BlockAc::op:
      return kBf16 * (d.F / d.t + d.D);
    case BlockAc::full:
      return 0;
  }
  return 0;
}
double saved_per_token(const Dims& d, BlockAc ac) {
  switch (ac) {
    case BlockAc::none:
      return kBf16 * (2 * d.D / d.t + 2 * d.D + 5 * d.Dq / d.t) + kF32 * d.H / d.t + 2 * kF32 +
             ffn_saved_per_token(d, ac);
    case BlockAc::op:
      return kBf16 * (d.D / d.t + d.Dq / d.t + d.Dkv / d.t + d.Dq / d.t) + kF32 * d.H / d.t +
             ffn_saved_per_token(d, ac);
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
// tensors: three of the FFN's hidden width and two of the model width (a
// mixture of experts: three of k·Fe, three of k·D and the fp32 gradient of
// the routed outputs, k·D).
double backward_temps_per_token(const Dims& d) {
  if (d.moe) return kBf16 * (3 * d.k * d.Fe + 3 * d.k * d.D + 2 * d.D) + kF32 * d.k * d.D;
  return kBf16 * (3 * d.F / d.t + 2 * d.D);
}

// Element-wise (memory-bound) HBM bytes per token of one block's forward in
// eager mode: two RMSNorms (read x, write y), RoPE on q and k in fp32 (cast
// up, complex multiply, cast down: 20 bytes per element), repeat_kv's copies
// (GQA only), the transpose back to contiguous, two residual adds, silu and
// the SwiGLU product. The backward moves about twice as much (each op reads
// the incoming gradient and its saved inputs and writes one gradient).
// A mixture of experts replaces the SwiGLU's with its experts' silu and
// product (k·Fe wide) and its routing: the router's fp32 cast, softmax and
// top-k (18 bytes per expert score), sorting and histograms (64 per route),
// four copies of the routed tokens (the gather by expert, the permutation
// for the grouped products and its inverse, the scatter back into a zeroed
// (T·k, D) buffer: 9 bf16 passes of k·D), their fp32 cast (6·k·D) read by
// the combining bmm (4·k·D), its fp32 output cast back (10·D).
double moe_routing_bytes_per_token(const Dims& d) {
  return 5 * kBf16 * d.k * d.Fe + (9 * kBf16 + 6 + 4) * d.k * d.D + 10 * d.D + 18 * d.E + 64 * d.k;
}
double elementwise_fwd_bytes_per_token(const Dims& d, bool gqa) {
  const double norms = 2 * 2 * kBf16 * d.D / d.t;
  const double rope = 20 * (d.Dq + d.Dkv) / d.t;
  const double repeat = gqa ? 2 * kBf16 * (d.Dkv + d.Dq) / d.t : 0;
  const double transpose = 2 * kBf16 * d.Dq / d.t;
  const double residual = 2 * 3 * kBf16 * d.D / d.t;
  const double swiglu = d.moe ? moe_routing_bytes_per_token(d) : (2 + 3) * kBf16 * d.F / d.t;
  return norms + rope + repeat + transpose + residual + swiglu;
}

// Cross-entropy over fp32 logits, HBM bytes per logit: the cast to fp32 (read
// 2, write 4), log_softmax (read 4, write 4); backward: nll's zero-filled
// gradient (4), log_softmax's backward (read 8, write 4), the cast back (read 4,
// write 2).
constexpr double kLossBytesPerLogit = 6 + 8 + 4 + 12 + 6;

// Which rates priced an estimate: the calibration file's or the table's.
struct RateUse {
  std::set<std::tuple<double, double, double>> gemm_measured, gemm_modelled;
  std::set<std::tuple<double, double, double, double, double>> attention_measured, attention_modelled;
  bool cp_chunks = false;  // attention over CP's chunks: no one shape to time, always modelled
};

// What each kind of kernel achieves on the GPU: the measured rates of
// estimate/gpu_hardware.h, not the datasheet's peaks; tensor-core work at the
// clock the GPU sustains at its power limit. A calibration file
// (estimate/gpu_calibration.h) replaces them with rates measured on the
// user's GPU: a product or attention call of a shape it timed takes that
// time; the others are modelled from its general rates where it has them.
struct Rates {
  const GpuHardware* hw;
  const GpuCalibration* cal = nullptr;  // none: the table's rates
  PricedShapes* priced = nullptr;       // where to note every shape priced (anvil calibrate --shapes)
  RateUse* use = nullptr;
  double matmul_flops() const { return cal && cal->matmul_flops ? *cal->matmul_flops : hw->matmul_flops; }
  // Wave quantization: a GEMM's M x N output is cut into tiles (256 x 128, the
  // largest cuBLAS tile on these GPUs, either way round) that run in waves of
  // one tile per SM; the last wave leaves SMs idle. The maximum achievable
  // matmul rate was measured at a shape that fills its waves. `groups`
  // outputs of M x N in one kernel (a grouped product) are tiled each, and
  // with `partial_tiles` a tile's empty part counts as lost too (an expert's
  // few hundred rows; a dense GEMM's edges are left to the measured rate).
  double wave_efficiency(double M, double N, double groups = 1, bool partial_tiles = false) const {
    const double sms = static_cast<double>(hw->sms);
    double best = 0;
    for (const auto& [a, b] : {std::pair{256.0, 128.0}, std::pair{128.0, 256.0}}) {
      const double tiles = groups * std::ceil(M / a) * std::ceil(N / b);
      const double fill = partial_tiles ? groups * M * N / (tiles * a * b) : 1;
      best = std::max(best, fill * tiles / (std::ceil(tiles / sms) * sms));
    }
    return best;
  }
  // (M x K) times (K x N) in bf16.
  double gemm(double M, double K, double N) const {
    const GemmShape shape{M, K, N};
    if (priced) priced->gemms.emplace(shape.key(), shape);
    if (cal) {
      const auto it = cal->gemm_seconds.find(shape.key());
      if (it != cal->gemm_seconds.end()) {
        if (use) use->gemm_measured.insert(shape.key());
        return it->second;
      }
    }
    if (use) use->gemm_modelled.insert(shape.key());
    return std::max(2 * M * K * N / (matmul_flops() * hw->sustained_clock_ratio * wave_efficiency(M, N)),
                    mem(kBf16 * (M * K + K * N + M * N)));
  }
  // `groups` products of M x K times K x N in one torch._grouped_mm (the
  // experts', M tokens each): each group's output cut into tiles, a group's
  // last tile partly empty when M is not a multiple of its side, all tiles in
  // waves over the SMs; at the rate grouped products are measured to reach
  // (GpuSoftware::grouped_gemm_efficiency of the dense one). Not calibrated:
  // modelled from the calibration's general rates when it has them.
  double grouped_gemm(double groups, double M, double K, double N) const {
    const double eff = (cal ? cal->software_figures() : gpu_software()).grouped_gemm_efficiency;
    return std::max(2 * groups * M * K * N /
                        (matmul_flops() * hw->sustained_clock_ratio * eff * wave_efficiency(M, N, groups, true)),
                    mem(kBf16 * groups * (M * K + K * N + M * N)));
  }
  double mem(double bytes) const {
    if (cal && cal->hbm_bandwidth) return bytes / *cal->hbm_bandwidth;
    return bytes / (hw->hbm_bandwidth * hw->hbm_efficiency);
  }
  double tensor_core_flops() const { return hw->peak_bf16_flops * hw->sustained_clock_ratio; }
  // Causal attention of `shape` with `fwd_flops` in its forward: the time the
  // calibration measured for that shape, else FlashAttention-2's forward
  // FLOPs and the backward's 2.5 times as many, each at its own efficiency.
  std::pair<double, double> attention(const std::optional<AttentionShape>& shape, double fwd_flops) const {
    if (shape && priced) priced->attention.emplace(shape->key(), *shape);
    if (shape && cal) {
      const auto it = cal->attention_seconds.find(shape->key());
      if (it != cal->attention_seconds.end()) {
        if (use) use->attention_measured.insert(shape->key());
        return it->second;
      }
    }
    if (use) {
      if (shape)
        use->attention_modelled.insert(shape->key());
      else
        use->cp_chunks = true;
    }
    return {fwd_flops / (tensor_core_flops() * hw->flash_forward_efficiency),
            2.5 * fwd_flops / (tensor_core_flops() * hw->flash_backward_efficiency)};
  }
};

// A linear layer over T tokens, `in` to `out` features: the forward GEMM and
// the backward's two (dX: T x out times out x in; dW: out x T times T x in),
// each with its own output shape and so its own wave quantization.
struct LinearTime {
  double fwd, dx, dw;
  double bwd() const { return dx + dw; }
};
LinearTime linear_time(const Rates& rt, double T, double in, double out) {
  return {rt.gemm(T, in, out), rt.gemm(T, out, in), rt.gemm(out, T, in)};
}
// The same for `groups` experts of M tokens each: dX is M x out times out x
// in per expert, dW out x M times M x in per expert.
LinearTime grouped_linear_time(const Rates& rt, double groups, double M, double in, double out) {
  return {rt.grouped_gemm(groups, M, in, out), rt.grouped_gemm(groups, M, out, in),
          rt.grouped_gemm(groups, out, M, in)};
}

// A collective's group: its ring bus bandwidth and the time a small collective takes.
struct Link {
  double busbw = 0, latency = 0;
};

// The ring of a group of n GPUs whose members are `stride` ranks apart
// (torchtitan's mesh is pp x dp_replicate x dp_shard x cp x tp, tp innermost,
// ranks filling nodes in order): NVLink inside a node; across nodes each
// node's members send through their own NICs in parallel (NCCL runs one ring
// per NIC), so the ring moves internode x members-per-node, capped by NVLink;
// each at the fraction NCCL is measured to reach (GpuSoftware).
Link ring_link(const GpuHardware& hw, int64_t n, int64_t stride) {
  const GpuSoftware& sw = gpu_software();
  const int64_t gpn = hw.gpus_per_node;
  const int64_t per_node = stride >= gpn ? 1 : std::min<int64_t>(n, gpn / stride);
  const double nvlink = hw.nvlink_bandwidth * sw.nvlink_efficiency;
  if (n <= per_node) return {nvlink, sw.intranode_latency};
  return {std::min(nvlink, hw.internode_bandwidth * static_cast<double>(per_node) * sw.internode_efficiency),
          sw.internode_latency};
}

// All-gather or reduce-scatter of `bytes` (the unsharded size) over n ranks.
double ring_seconds(double bytes, int64_t n, const Link& link) {
  return n <= 1 ? 0 : link.latency + bytes * static_cast<double>(n - 1) / static_cast<double>(n) / link.busbw;
}

// The all-to-all of n consecutive ranks (expert parallelism's group; tp is 1
// under a mixture of experts): each rank sends (n - 1)/n of its buffer
// away. Inside a node at NVLink × NCCL's all-to-all efficiency; across nodes
// the share that leaves the node, (nodes - 1)/nodes of the buffer, goes
// through the GPU's own NIC (an all-to-all cannot stripe over the node's
// NICs), at the efficiency nccl-tests reaches; one small collective's latency.
double alltoall_seconds(const GpuHardware& hw, double bytes, int64_t n) {
  if (n <= 1) return 0;
  const GpuSoftware& sw = gpu_software();
  const double gpn = static_cast<double>(hw.gpus_per_node), ranks = static_cast<double>(n);
  if (ranks <= gpn)
    return sw.intranode_latency + bytes * (ranks - 1) / ranks / (hw.nvlink_bandwidth * sw.alltoall_nvlink_efficiency);
  const double nodes = ranks / gpn;
  return sw.internode_latency +
         bytes * (nodes - 1) / nodes / (hw.internode_bandwidth * sw.alltoall_internode_efficiency);
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
  ANVIL_CHECK(sp.dp_replicate >= 1 && sp.dp_shard >= 1 && sp.cp >= 1 && sp.tp >= 1 && sp.pp >= 1 && sp.ep >= 1,
              "parallel degrees must be positive");
  ANVIL_CHECK(sp.ep == 1 || a.moe(), "parallelism.expert_parallel_degree ", sp.ep, " splits a mixture of experts, but ",
              a.name, "/", a.flavor, " is dense");
  ANVIL_CHECK(!a.moe() || sp.tp == 1, "parallelism.tensor_parallel_degree ", sp.tp, ": the GPU planner prices ", a.name,
              "/", a.flavor,
              "'s mixture of experts without tensor parallelism (torchtitan has deprecated splitting the experts "
              "over TP); use expert_parallel_degree and FSDP");
  ANVIL_CHECK(sp.ep == 1 || (a.num_experts % sp.ep == 0 && (sp.dp_shard * sp.cp) % sp.ep == 0),
              "parallelism.expert_parallel_degree ", sp.ep, " must divide the ", a.num_experts,
              " experts and data_parallel_shard_degree x context_parallel_degree = ", sp.dp_shard * sp.cp,
              " (torchtitan takes the expert-parallel ranks from them)");
  ANVIL_CHECK(!sp.autocast() || (sp.tp == 1 && sp.pp == 1 && sp.dp_replicate == 1),
              "parallelism.data_parallel_shard_degree x context_parallel_degree is 1 with ",
              sp.tp > 1   ? "tensor"
              : sp.pp > 1 ? "pipeline"
                          : "replicated data",
              " parallelism: torchtitan then trains in fp32 (TP, PP) or under DDP, which the GPU planner does not "
              "model; use a shard degree of 2 or more, or one GPU (bf16 autocast), or "
              "--parallelism.fsdp_single_rank true");
  ANVIL_CHECK(!sp.fsdp_single_rank || sp.dp_shard * sp.cp == 1,
              "parallelism.fsdp_single_rank is for a shard degree of 1, not ", sp.dp_shard * sp.cp);
  ANVIL_CHECK(sp.cp == 1 || sp.seq_len % (2 * sp.cp) == 0, "context parallelism cuts every sequence into 2 x ", sp.cp,
              " chunks, which must divide training.seq_len ", sp.seq_len);
  ANVIL_CHECK(a.n_heads % sp.tp == 0 && a.n_kv_heads % sp.tp == 0, "parallelism.tensor_parallel_degree ", sp.tp,
              " does not divide ", a.name, "/", a.flavor, "'s ", a.n_heads, " heads and ", a.n_kv_heads, " KV heads");
  ANVIL_CHECK(sp.seq_len >= 1 && sp.local_batch >= 1,
              "training.seq_len and training.local_batch_size must be positive");
  ANVIL_CHECK(!a.tie_embeddings || sp.pp == 1, a.name, "/", a.flavor,
              " ties its embedding to its head, which pipeline stages cannot share");
  ANVIL_CHECK(sp.grad_accum >= 1 && sp.local_batch % sp.grad_accum == 0, "training.local_batch_size ", sp.local_batch,
              " is not a multiple of the gradient accumulation steps ", sp.grad_accum);
  ANVIL_CHECK(sp.cp_rotate == "allgather" || sp.cp_rotate == "ring", "parallelism.context_parallel_rotate_method \"",
              sp.cp_rotate, "\": the GPU planner models allgather and ring");
  if (sp.pp > 1) {
    ANVIL_CHECK(sp.microbatch_size >= 1 && (sp.local_batch / sp.grad_accum) % sp.microbatch_size == 0,
                "training.local_batch_size ", sp.local_batch, " over ", sp.grad_accum,
                " accumulation steps is not a multiple of parallelism.pipeline_parallel_microbatch_size ",
                sp.microbatch_size);
  }
}

// What every stage's memory and time derive from: the run's dimensions per
// GPU, its parameter counts per group, the kernels' rates and the links.
struct RunTerms {
  const GpuRunSpec& sp;
  Dims d;
  bool gqa, v010;
  int64_t m;  // micro-batches per step (pipeline), 1 otherwise
  double t, c, N, s, T,
      Vt;  // tp, cp, shards (dp_shard · cp), seq_len, tokens per micro-batch per GPU, vocabulary per GPU
  double layer_params, emb_params, head_params;
  // A mixture of experts: a block's experts on this GPU (its ep share) and in
  // all (what the FSDP shards split); 0 for a dense model.
  double layer_expert_params, layer_all_expert_params;
  Rates rt;
  Link shard, rep, tp_link, cp_link;
  Link expert_shard;  // the experts' FSDP group (dp_shard · cp / ep ranks, ep apart) under expert parallelism
  double p2p_bandwidth;           // a pipeline boundary's send, bytes/s
  GpuSoftware sw;                 // NCCL's and eager PyTorch's figures (a calibration's where it has them)
  double collective_sm_fraction;  // of the SMs, what a collective beside compute takes
};

Dims model_dims(const ModelArgs& a, int64_t tp) {
  return Dims{static_cast<double>(a.dim),
              static_cast<double>(a.n_heads * a.head_dim()),
              static_cast<double>(a.n_kv_heads * a.head_dim()),
              static_cast<double>(a.ffn_hidden_dim()),
              static_cast<double>(a.n_heads),
              static_cast<double>(a.vocab_size),
              static_cast<double>(tp),
              a.moe(),
              static_cast<double>(a.num_experts),
              static_cast<double>(a.experts_per_token),
              static_cast<double>(a.moe_ffn_hidden)};
}

RunTerms run_terms(const GpuRunSpec& sp, const GpuHardware& hw, const Rates& rates) {
  const ModelArgs& a = sp.model;
  const double t = static_cast<double>(sp.tp);
  const Dims d = model_dims(a, sp.tp);
  const double all_experts = a.moe() ? 3 * d.D * d.Fe * d.E : 0;
  const double ep = static_cast<double>(sp.ep);
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
      static_cast<double>(sp.pp > 1 ? sp.microbatch_size : sp.local_batch / sp.grad_accum) * s /
          static_cast<double>(sp.cp),
      d.V / t,
      // Parameters per GPU (after TP): the block's matrices are split, its norms
      // replicated; under EP its share of the experts.
      static_cast<double>(a.params_per_layer() - 2 * a.dim) / t + 2 * d.D - all_experts * (1 - 1 / ep),
      d.D * (d.V / t),
      // The head's matrix is the embedding's when the flavour ties them (Llama 3.2 1B, 3B): counted once.
      (a.tie_embeddings ? 0 : d.D * (d.V / t)) + d.D,
      all_experts / ep,
      all_experts,
      rates,
      ring_link(hw, sp.dp_shard * sp.cp, sp.tp),
      ring_link(hw, sp.dp_replicate, sp.tp * sp.cp * sp.dp_shard),
      ring_link(hw, sp.tp, 1),
      ring_link(hw, sp.cp, sp.tp),
      ring_link(hw, sp.dp_shard * sp.cp / sp.ep, sp.ep * sp.tp),
      pp_stride < hw.gpus_per_node ? hw.nvlink_bandwidth * gpu_software().nvlink_efficiency
                                   : hw.internode_bandwidth * gpu_software().internode_efficiency,
      rates.cal ? rates.cal->software_figures() : gpu_software(),
      static_cast<double>(gpu_software().collective_sms) / static_cast<double>(hw.sms),
  };
}

// A stage's parameter counts: its root group (embedding, final norm, head),
// all of them on a GPU (its experts only, under EP), the experts among those,
// and what the GPU's FSDP shards split (every expert: EP's groups of experts
// are sharded over dp_shard · cp / ep ranks, so each GPU keeps 1/(dp_shard · cp)
// of every parameter either way).
struct StageParams {
  double root, psi, experts, state;
};
StageParams stage_params(const RunTerms& r, const StageShape& st) {
  const double root = (st.embedding ? r.emb_params : 0) + (st.head ? r.head_params : 0);
  const double L = static_cast<double>(st.layers);
  const double psi = L * r.layer_params + root;
  return {root, psi, L * r.layer_expert_params, psi + L * (r.layer_all_expert_params - r.layer_expert_params)};
}

// Under expert parallelism torchtitan shards the experts over their own
// group (fully_shard(moe.experts) on the dp_shard · cp / ep mesh), one FSDP
// group per block beside the block's; without it they are in the block's.
bool experts_apart(const RunTerms& r) { return r.sp.ep > 1; }

// Muon's matrices in a block, per tp rank, every expert's (the units of
// StageParams::state): the attention's four projections and the feed-forward's
// three (each expert's three). A stage's: times its blocks.
double layer_matrix_params(const RunTerms& r) {
  const Dims& d = r.d;
  const double attention = 2 * d.D * d.Dq + 2 * d.D * d.Dkv;
  const double feed_forward = d.moe ? 3 * d.D * d.Fe * d.E : 3 * d.D * d.F;
  return (attention + feed_forward) / r.t;
}
double muon_matrix_params(const RunTerms& r, const StageShape& st) {
  return r.sp.muon ? static_cast<double>(st.layers) * layer_matrix_params(r) : 0;
}

// The largest of a block's matrices, whole (rows, cols).
std::pair<double, double> largest_matrix(const RunTerms& r) {
  const Dims& d = r.d;
  const double ff = d.moe ? d.Fe : d.F;
  return ff * d.D >= d.Dq * d.D ? std::pair{ff, d.D} : std::pair{d.Dq, d.D};
}

// Muon's step on one GPU: Newton-Schulz on the matrices it owns (the
// dp_shard · cp × tp ranks holding parts of a block's matrices take them in
// turn, so each does 1/(N·t) of the work, whole matrices at their global
// shapes, bf16 GEMMs at the measured rates), its elementwise passes over
// its shard (kMuonBytesPerParam), and the two all-to-alls per block and
// level: over the shard group 8·M·(n − 1)/n² bytes a rank for M matrix
// elements (per tp rank) sharded over n, then over the tp group each slice's
// holder (1/n of them) sending 8·(M/n)·(t − 1)/t (docs/muon.md). Under expert
// parallelism the experts' shard group is dp_shard · cp / ep ranks of its own.
double muon_seconds(const RunTerms& r, const StageShape& st) {
  const GpuRunSpec& sp = r.sp;
  if (!sp.muon || st.layers == 0) return 0;
  const Dims& d = r.d;
  const Rates& rt = r.rt;
  const double steps = static_cast<double>(sp.muon_ns_steps), L = static_cast<double>(st.layers);
  // NS_k on the wide form a × b (a ≤ b): per step X·Xᵀ, G·G and H·X.
  auto ns = [&](double rows, double cols) {
    const double a = std::min(rows, cols), b = std::max(rows, cols);
    return steps * (rt.gemm(a, b, a) + rt.gemm(a, a, a) + rt.gemm(a, a, b));
  };
  const double attention = 2 * ns(d.Dq, d.D) + 2 * ns(d.Dkv, d.D);
  const double feed_forward = d.moe ? d.E * (3 * ns(d.Fe, d.D)) : 3 * ns(d.F, d.D);
  const double newton_schulz = L * (attention + feed_forward) / (r.N * r.t);
  const double matrices = muon_matrix_params(r, st);
  const double passes = rt.mem(kMuonBytesPerParam * matrices / r.N);
  auto all_to_alls = [&](double elements, double n, const Link& link) {
    if (n <= 1) return 0.0;
    return 2 * kF32 * elements * (n - 1) / (n * n) / link.busbw + 2 * L * link.latency;
  };
  const double experts = experts_apart(r) ? L * 3 * d.D * d.Fe * d.E / r.t / static_cast<double>(sp.ep) : 0;
  const double dense = matrices - (experts_apart(r) ? L * 3 * d.D * d.Fe * d.E / r.t : 0);
  double traffic = all_to_alls(dense, r.N, r.shard) +
                   all_to_alls(experts, r.N / static_cast<double>(sp.ep), r.expert_shard);
  if (r.t > 1) traffic += 2 * kF32 * (matrices / r.N) * (r.t - 1) / r.t / r.tp_link.busbw + 2 * L * r.tp_link.latency;
  return newton_schulz + passes + traffic;
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
struct StageMemory {
  GpuStageMemory mem;
  double persistent = 0;  // what the stage holds throughout its step: states, gathered weights, in-flight activations
  double compute_reserved = 0;  // the compute stream's pool
};
StageMemory stage_memory(const RunTerms& r, const StageShape& st, int stage, int in_flight) {
  const GpuRunSpec& sp = r.sp;
  const Dims& d = r.d;
  const double t = r.t, N = r.N, T = r.T, m = static_cast<double>(r.m);
  const auto [root, psi, experts, state] = stage_params(r, st);
  GpuStageMemory mem;
  mem.stage = stage;
  mem.layers = st.layers;
  mem.has_embedding = st.embedding;
  mem.has_head = st.head;
  mem.in_flight = in_flight;
  mem.parameters = kF32 * state / N;
  // Muon keeps one fp32 momentum per matrix element, AdamW two moments per other element.
  const double matrices = sp.muon ? muon_matrix_params(r, st) : 0;
  mem.optimizer = kF32 * (2 * state - matrices) / N;
  mem.gradients = kF32 * state / N;
  // The all-gather stream's pool: at most two all-gathers in flight (FSDP2),
  // so the two largest groups' flat bf16 buffers stay cached.
  std::vector<double> groups(static_cast<size_t>(st.layers),
                             r.layer_params - (experts_apart(r) ? r.layer_expert_params : 0));
  if (experts_apart(r)) groups.insert(groups.end(), static_cast<size_t>(st.layers), r.layer_expert_params);
  if (root > 0) groups.push_back(root);
  std::sort(groups.rbegin(), groups.rend());
  const double largest_group = groups.empty() ? 0 : groups[0];
  // Autocast has no collectives: one stream, one pool, the gradients in it.
  mem.allgather_pool = sp.autocast() ? 0 : kBf16 * (largest_group + (groups.size() > 1 ? groups[1] : 0));
  mem.reduce_pool_extra = r.v010 || sp.autocast() ? 0 : kF32 * largest_group;
  const double own_pool_grads = sp.autocast() ? mem.gradients : 0;  // gradients on the compute stream

  // Activations of one micro-batch on this stage, and the largest block transient.
  double acts = 0, block_transient = 0;
  for (int64_t l = st.first_layer; l < st.first_layer + st.layers; ++l) {
    const BlockAc ac = block_ac(sp.ac, l - st.first_layer);
    // Under autocast the residual stream stays fp32 (the embedding and the adds are not autocast), so
    // each block's saved norm inputs take 4 bytes an element, not 2 (AC full keeps the block's input: one).
    acts += (saved_per_token(d, ac) + (sp.autocast() ? (ac == BlockAc::full ? 1 : 2) * (kF32 - kBf16) * d.D : 0)) * T;
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
  if (sp.autocast()) {
    // Autocast's bf16 copy of every weight: made in the forward, kept by the
    // product for its backward (the cast cache lives until the forward ends,
    // the saved copy until the weight's gradient is made). At the loss's
    // backward all of them are alive.
    gathered = kBf16 * psi;
  } else if (sp.pp > 1) {
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
    Candidate c;  // AdamW's step: sqrt(exp_avg_sq) is one fp32 temporary the size of its shards
    c.parts.working = kF32 * (state - matrices) / N;
    // Muon's: a block's send and receive buffers (this rank's runs of its
    // matrices, and every rank's of those it owns: 2/N of the block's matrix
    // elements, fp32), and on the owner the largest matrix's u and o (fp32)
    // with Newton-Schulz's bf16 iterates, their f32 product and the r × r Gram
    // matrices (ops/muon.cpp's buffers).
    if (sp.muon && st.layers > 0) {
      const auto [rows, cols] = largest_matrix(r);
      const double rr = std::min(rows, cols);
      c.parts.working = std::max(c.parts.working, 2 * kF32 * matrices / static_cast<double>(st.layers) / N +
                                                      (3 * kF32 + 2 * kBf16) * rows * cols + 2 * kBf16 * rr * rr);
    }
    c.parts.kept_outputs = kept_all;
    c.parts.peak_at = "optimizer step";
    c.total = mem.parameters + mem.optimizer + mem.pp_buffers + c.parts.working + kept_all + own_pool_grads;
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
  mem.peak_allocated = best->total + (mem.peak_at == "optimizer step" ? mem.gradients - own_pool_grads : 0);
  mem.reserved = compute_reserved + mem.gradients - own_pool_grads + mem.reduce_pool_extra + mem.allgather_pool;
  return {mem, base + inflight_acts + kept_all, compute_reserved};
}

// Eager PyTorch's host work per block, counted in torchtitan's Llama 3 block
// (models/llama3/model/model.py: TransformerBlock, Attention with SDPA,
// apply_rotary_emb, FeedForward, nn.RMSNorm) and the autograd graph it records
// (docs/estimator.md, "Short steps"): the forward's 39 Python-level ops, 21
// of them launching a kernel; the backward's 69 node evaluations, 20 of them
// launching kernels, 9 AccumulateGrad (one per parameter tensor), 40 others
// (views, transposes, reshapes). Autocast adds a cast per weight in the
// forward and its backward node. The embedding, final norm, head and loss
// add about 10 ops (6 launches) and as many nodes.
struct HostWork {
  double ops = 0, launches = 0, nodes = 0, accumulates = 0;
  double seconds(const GpuSoftware& sw) const {
    return ops * sw.host_seconds_per_op + launches * sw.host_seconds_per_launch +
           nodes * sw.host_seconds_per_backward_node + accumulates * sw.host_seconds_per_accumulate;
  }
};
constexpr HostWork kBlockForward{39, 21, 0, 0};
constexpr HostWork kBlockBackward{0, 20, 60, 9};
constexpr HostWork kCastForward{7, 7, 0, 0};   // autocast: each of the block's 7 weights cast to bf16
constexpr HostWork kCastBackward{0, 7, 7, 0};  // ... and its ToCopyBackward
constexpr HostWork kEndsForward{10, 6, 0, 0};  // embedding, final norm, head, loss
constexpr HostWork kEndsBackward{0, 6, 10, 0};
constexpr double kTensorsPerBlock = 9;  // wq, wk, wv, wo, w1, w2, w3 and the two norms
// A mixture of experts in place of the FFN (counted in torchtitan's
// models/moe/moe.py at v0.2.2): the router (gate, fp32 cast, softmax, top-k,
// gather, renormalisation, histogram), the reorderer (histogram, argsort,
// gathers), the padding permutation, three grouped products, silu and product,
// the unpermute, the zeroed scatter, the fp32 cast, bmm and cast back: about
// 50 ops, 32 launching, against the FFN's 5; in the backward about 30 nodes,
// 23 launching, against the FFN's 8; one more parameter tensor (the gate).
// Expert parallelism adds the dispatch (the counts' all-to-all, their copy to
// the host, the tokens' all-to-all, the permutation) and the combine in place
// of the padding permutation.
constexpr HostWork kMoeForward{45, 27, 0, 0};
constexpr HostWork kMoeBackward{0, 18, 22, 1};
constexpr HostWork kEpForward{14, 7, 0, 0};
constexpr HostWork kEpBackward{0, 6, 6, 0};

// The FFN's products on T tokens: w1 and w3 (one shape), w2. A mixture of
// experts: the router's gate and the grouped products of the GPU's E/ep
// experts, each with the balanced share of the T·k routes its EP group
// exchanges, T·k·ep/E (no gate for a dense FFN).
struct FfnProducts {
  LinearTime gate, w13, w2;
};
FfnProducts ffn_products(const Rates& rt, const Dims& d, double T, int64_t ep_degree) {
  if (!d.moe) return {{}, linear_time(rt, T, d.D, d.F / d.t), linear_time(rt, T, d.F / d.t, d.D)};
  const double ep = static_cast<double>(ep_degree), local = d.E / ep, M = T * d.k * ep / d.E;
  return {linear_time(rt, T, d.D, d.E), grouped_linear_time(rt, local, M, d.D, d.Fe),
          grouped_linear_time(rt, local, M, d.Fe, d.D)};
}

// One micro-batch's time on a stage (compute, tensor-parallel collectives,
// FSDP's copies) and the step's FSDP traffic and optimizer time.
struct StageTime {
  double fwd = 0, bwd = 0;            // GPU time of the forward and the whole backward (recomputation included)
  double bwd_weight = 0;              // of bwd, the weight gradients (dW GEMMs): a zero-bubble schedule's W
  double host_fwd = 0, host_bwd = 0;  // eager PyTorch's CPU time to dispatch them
  double host_fsdp = 0;               // FSDP2's hooks over the step: unshards and reduces, per micro-step
  double host_optimizer = 0;          // the optimizer's and gradient clipping's host time per step
  double tp_fwd = 0, tp_bwd = 0, cp_fwd = 0, cp_bwd = 0, ep_fwd = 0, ep_bwd = 0;  // exposed collectives
  double cp_hidden = 0;  // ring CP: transfer time overlapped with attention (it takes SMs from it)
  double fsdp_mem = 0, optimizer = 0;  // GPU time: FSDP's (or autocast's) copies, the optimizer and clipping
  double rs = 0, ar = 0, fsdp_comm = 0, first_group_ag = 0;
  double p2p = 0;  // the boundary tensor sent on, or its gradient back
};

// Context parallelism's per-layer communication. The all-gather rotation
// (torchtitan's default) gathers the whole sequences' K and V in the forward
// (bf16, Dq wide: torchtitan repeats GQA's KV heads first), and in the
// backward gathers them again and reduce-scatters their fp32 gradients, none
// of it overlapped. The ring passes each rank's block on cp - 1 times, each
// transfer beside one block's attention; only what the attention does not
// cover is exposed, the rest takes the collective's SMs from it.
struct CpLayerTime {
  double fwd = 0, bwd = 0, recompute = 0;  // exposed
  double hidden_fwd = 0, hidden_bwd = 0;   // overlapped with attention
};
CpLayerTime cp_layer_time(const RunTerms& r, double attn_fwd, double attn_bwd) {
  const GpuRunSpec& sp = r.sp;
  CpLayerTime out;
  if (sp.cp == 1) return out;
  const double kv = cp_kv_elements(r);
  if (sp.cp_rotate == "allgather") {
    const double gather = ring_seconds(kBf16 * kv, sp.cp, r.cp_link);
    out.fwd = gather;
    out.bwd = gather + ring_seconds(kF32 * kv, sp.cp, r.cp_link);
    out.recompute = gather;
    return out;
  }
  const double steps = static_cast<double>(sp.cp - 1), c = static_cast<double>(sp.cp);
  const double block = kv / c;  // one rank's K and V
  const double send_fwd = r.cp_link.latency + kBf16 * block / r.cp_link.busbw;
  const double send_bwd =
      r.cp_link.latency + (kBf16 + kF32) * block / r.cp_link.busbw;  // K, V and their gradients' sums
  const double a_fwd = attn_fwd / c, a_bwd = attn_bwd / c;
  out.fwd = steps * std::max(0.0, send_fwd - a_fwd);
  out.hidden_fwd = steps * std::min(send_fwd, a_fwd);
  out.bwd =
      steps * std::max(0.0, send_bwd - a_bwd) + r.cp_link.latency + kF32 * block / r.cp_link.busbw;  // last hop home
  out.hidden_bwd = steps * std::min(send_bwd, a_bwd);
  out.recompute = out.fwd;
  return out;
}

StageTime stage_time(const RunTerms& r, const StageShape& st) {
  const GpuRunSpec& sp = r.sp;
  const Dims& d = r.d;
  const Rates& rt = r.rt;
  const double t = r.t, T = r.T, N = r.N, m = static_cast<double>(r.m);
  const auto [root, psi, experts, state] = stage_params(r, st);
  StageTime out;
  // 4·T·s·Dq, halved by the causal mask; under CP T is the rank's share of
  // the queries over the whole sequence's keys (head-tail: an equal share of the work).
  const double attn_fwd_flops = 2 * T * r.s * d.Dq / t;
  // Without CP a micro-batch's attention is one call over whole sequences, a
  // shape a calibration can time; CP's chunks are modelled.
  std::optional<AttentionShape> attn_shape;
  if (sp.cp == 1) attn_shape = AttentionShape{T / r.s, r.s, r.s, d.H / t, d.Dq / d.H};
  // Block-causal attention skips the tiles its documents mask: its time is the share of the pairs it keeps.
  const double kept = block_causal_share(sp.seq_len, sp.mean_document_tokens);
  auto [attn, attn_bwd] = rt.attention(attn_shape, attn_fwd_flops);
  attn *= kept, attn_bwd *= kept;
  const CpLayerTime cp = cp_layer_time(r, attn, attn_bwd);
  const double ew_fwd = rt.mem(elementwise_fwd_bytes_per_token(d, r.gqa) * T);
  const double tp_coll = sp.tp > 1 ? ring_seconds(kBf16 * T * d.D, sp.tp, r.tp_link) : 0;
  const LinearTime wq = linear_time(rt, T, d.D, d.Dq / t), wkv = linear_time(rt, T, d.D, d.Dkv / t),
                   wo = linear_time(rt, T, d.Dq / t, d.D);
  const auto [gate, w13, w2] = ffn_products(rt, d, T, sp.ep);
  const double ffn_fwd = gate.fwd + 2 * w13.fwd + w2.fwd;
  const double gemm_fwd = wq.fwd + 2 * wkv.fwd + wo.fwd + ffn_fwd;
  const double gemm_bwd = wq.bwd() + 2 * wkv.bwd() + wo.bwd() + gate.bwd() + 2 * w13.bwd() + w2.bwd();
  const double gemm_dw = wq.dw + 2 * wkv.dw + wo.dw + gate.dw + 2 * w13.dw + w2.dw;
  // Expert parallelism's exchanges, on the compute stream and waited for:
  // the forward's counts (one small all-to-all), the tokens out (k·D bf16 per
  // token) and the experts' outputs back; the backward's two of the gradients.
  const double a2a = alltoall_seconds(*r.rt.hw, kBf16 * T * d.k * d.D, sp.ep);
  const double a2a_fwd = sp.ep > 1 ? 2 * a2a + alltoall_seconds(*r.rt.hw, 0, sp.ep) : 0, a2a_bwd = 2 * a2a;
  const HostWork moe_fwd_host = d.moe ? kMoeForward : HostWork{}, ep_fwd_host = sp.ep > 1 ? kEpForward : HostWork{};
  const double host_moe_fwd = moe_fwd_host.seconds(r.sw) + ep_fwd_host.seconds(r.sw);
  const double host_moe_bwd = (d.moe ? kMoeBackward.seconds(r.sw) : 0) + (sp.ep > 1 ? kEpBackward.seconds(r.sw) : 0);
  for (int64_t l = st.first_layer; l < st.first_layer + st.layers; ++l) {
    out.fwd += gemm_fwd + attn + ew_fwd;
    out.bwd += gemm_bwd + attn_bwd + 2 * ew_fwd;  // each op's backward moves about twice its forward's bytes
    out.bwd_weight += gemm_dw;
    out.host_fwd += kBlockForward.seconds(r.sw) + host_moe_fwd + (sp.autocast() ? kCastForward.seconds(r.sw) : 0);
    out.host_bwd += kBlockBackward.seconds(r.sw) + host_moe_bwd + (sp.autocast() ? kCastBackward.seconds(r.sw) : 0);
    out.tp_fwd += 4 * tp_coll;  // sequence parallel: all-gather and reduce-scatter around both halves
    out.tp_bwd += 4 * tp_coll;
    out.cp_fwd += cp.fwd;
    out.cp_bwd += cp.bwd;
    out.cp_hidden += cp.hidden_fwd + cp.hidden_bwd;
    out.ep_fwd += a2a_fwd;
    out.ep_bwd += a2a_bwd;
    switch (block_ac(sp.ac, l - st.first_layer)) {
      case BlockAc::none:
        break;
      case BlockAc::op:
        // Every second mm (wk, wo, w3) and the element-wise ops, not attention;
        // a mixture of experts keeps only its gate's output: its grouped
        // products and all-to-alls run again.
        out.bwd += wkv.fwd + wo.fwd + (d.moe ? 2 * w13.fwd + w2.fwd : w13.fwd) + ew_fwd;
        out.host_bwd += kBlockForward.seconds(r.sw) + host_moe_fwd;
        out.tp_bwd += 2 * tp_coll;
        out.ep_bwd += a2a_fwd;
        break;
      case BlockAc::full:
        out.bwd += gemm_fwd + attn + ew_fwd;
        out.host_bwd += kBlockForward.seconds(r.sw) + host_moe_fwd;
        out.tp_bwd += 4 * tp_coll;
        out.cp_bwd += cp.recompute;
        out.cp_hidden += cp.hidden_fwd;
        out.ep_bwd += a2a_fwd;
        break;
    }
  }
  if (st.embedding) {
    out.fwd += rt.mem(2 * kBf16 * T * d.D / t);
    const double dense_grad = rt.mem(2 * kBf16 * d.V * d.D / t + kBf16 * T * d.D / t);  // a dense gradient of the table
    out.bwd += dense_grad;
    out.bwd_weight += dense_grad;
  }
  if (st.embedding || st.head) {
    out.host_fwd += kEndsForward.seconds(r.sw);
    out.host_bwd += kEndsBackward.seconds(r.sw);
  }
  if (st.head) {
    const double logits = T * r.Vt;
    const LinearTime out_proj = linear_time(rt, T, d.D, r.Vt);
    out.fwd += out_proj.fwd + rt.mem(2 * kBf16 * T * d.D / t);
    out.bwd += out_proj.bwd() + rt.mem(kLossBytesPerLogit * logits + 4 * kBf16 * T * d.D / t);
    out.bwd_weight += out_proj.dw;
  }
  // FSDP's copies: all-gather copy-out (read and write bf16), reduce-scatter
  // copy-in. Under autocast instead: each weight cast to bf16 in the forward
  // (read fp32, write bf16) and its bf16 gradient cast to fp32 in the backward.
  const double gathers = sp.pp > 1 ? 1 : 2;
  if (sp.autocast())
    out.fsdp_mem = rt.mem(2 * (kF32 + kBf16) * psi);
  else
    out.fsdp_mem = rt.mem(gathers * 2 * kBf16 * psi +
                          (sp.pp > 1 ? (kBf16 + kF32) * psi + (kBf16 + 2 * kF32) * psi * (m - 1) + 2 * kF32 * psi
                                     : (kBf16 + kF32) * psi));
  // AdamW over the parameters Muon does not take (all of them without Muon), then Muon's step.
  const double adamw_bytes = r.v010 ? kFusedAdamwBytesPerParam : kForeachAdamwBytesPerParam;
  const double matrices = sp.muon ? muon_matrix_params(r, st) : 0;
  out.optimizer = rt.mem(adamw_bytes * (state - matrices) / N) + muon_seconds(r, st);
  // FSDP traffic per step: gathers of bf16 weights (forward, and again in
  // backward after resharding, except the root and the last block), a
  // reduce-scatter of fp32 gradients, HSDP's all-reduce of the shards; one
  // collective per group each time. Under expert parallelism the blocks'
  // experts are groups of their own, over dp_shard · cp / ep ranks.
  const int64_t n = sp.dp_shard * sp.cp;
  const bool apart = experts_apart(r) && st.layers > 0;
  const double dense = psi - (apart ? experts : 0);
  const double dense_layer = r.layer_params - (apart ? r.layer_expert_params : 0);
  const double groups = static_cast<double>(st.layers) + (root > 0 ? 1 : 0);
  const double gathered_groups = sp.pp > 1 ? groups : 2 * groups - (root > 0 ? 1 : 0) - (st.layers > 0 ? 1 : 0);
  const double ag_bytes = kBf16 * (sp.pp > 1 ? dense : dense + (dense - root - (st.layers > 0 ? dense_layer : 0)));
  auto traffic = [&](double bytes, int64_t ranks, const Link& link, double calls) {
    return ranks <= 1 ? 0.0 : ring_seconds(bytes, ranks, link) + (calls - 1) * link.latency;
  };
  out.rs = traffic(kF32 * dense, n, r.shard, groups);
  out.ar = 2 * traffic(kF32 * dense / N, sp.dp_replicate, r.rep, groups);
  out.fsdp_comm = traffic(ag_bytes, n, r.shard, gathered_groups) + out.rs + out.ar;
  double expert_groups = 0, expert_gathers = 0;
  if (apart) {
    const int64_t ne = n / sp.ep;
    expert_groups = static_cast<double>(st.layers);
    expert_gathers = sp.pp > 1 ? expert_groups : 2 * expert_groups - 1;
    const double expert_ag = kBf16 * (sp.pp > 1 ? experts : 2 * experts - r.layer_expert_params);
    const double expert_rs = traffic(kF32 * experts, ne, r.expert_shard, expert_groups);
    const double expert_ar =
        2 * traffic(kF32 * experts / static_cast<double>(ne), sp.dp_replicate, r.rep, expert_groups);
    out.rs += expert_rs;
    out.ar += expert_ar;
    out.fsdp_comm += traffic(expert_ag, ne, r.expert_shard, expert_gathers) + expert_rs + expert_ar;
  }
  out.first_group_ag = ring_seconds(kBf16 * (st.embedding && root > 0 ? root : dense_layer), n, r.shard);
  // The host's share: FSDP2 walks a group's parameters in every unshard and
  // reduce (one rank included: it copies instead of gathering); the fused
  // optimizer and clipping visit every parameter tensor, DTensors under FSDP2.
  const double tensors = (kTensorsPerBlock + (d.moe ? 1 : 0)) * static_cast<double>(st.layers) +
                         (st.embedding ? 1 : 0) + (st.head ? (sp.model.tie_embeddings ? 1 : 2) : 0);
  if (!sp.autocast())
    out.host_fsdp = (gathered_groups + groups + expert_gathers + expert_groups) * r.sw.fsdp_hook_seconds;
  out.host_optimizer =
      tensors * (sp.autocast() ? r.sw.plain_optimizer_seconds_per_tensor + r.sw.host_seconds_per_op
                               : r.sw.dtensor_optimizer_seconds_per_tensor + r.sw.dtensor_op_seconds);
  out.p2p = kBf16 * T * d.D / t / r.p2p_bandwidth;
  return out;
}

// Without pipeline parallelism: each of the accumulation's micro-steps runs
// the forward and backward with FSDP's collectives beside compute, except the
// first group's all-gather (nothing to hide it) and the root's reduce-scatter
// and all-reduce (the backward's last); a collective beside compute takes its
// SMs from it; eager PyTorch's dispatch sets the pace when it is slower than
// the GPU. Then the optimizer steps.
void single_stage_step(const RunTerms& r, const StageShape& st, const StageTime& time, GpuStepEstimate& out) {
  const GpuRunSpec& sp = r.sp;
  const double a = static_cast<double>(sp.grad_accum);
  const double root = stage_params(r, st).root;
  const int64_t n = sp.dp_shard * sp.cp;
  const double compute = time.fwd + time.bwd + time.fsdp_mem;
  const double tp_comm = time.tp_fwd + time.tp_bwd, cp_comm = time.cp_fwd + time.cp_bwd,
               ep_comm = time.ep_fwd + time.ep_bwd;
  const double last_rs =
      ring_seconds(kF32 * root, n, r.shard) + 2 * ring_seconds(kF32 * root / r.N, sp.dp_replicate, r.rep);
  const double edges = time.first_group_ag + last_rs;
  const double hidden = std::max(0.0, time.fsdp_comm - edges);
  const double base = compute + tp_comm + cp_comm + ep_comm;
  const double contention = r.collective_sm_fraction * (std::min(hidden, base) + time.cp_hidden);
  const double gpu = base + contention, host = time.host_fwd + time.host_bwd + time.host_fsdp;
  const double comm_excess = std::max(0.0, hidden - std::max(gpu, host));
  // Nothing waits for the GPU inside a step, so the host runs ahead: the
  // optimizer's and clipping's host work overlaps the backward's last kernels,
  // and their kernels start once both are done. The host paces the step when
  // its forward, backward and optimizer dispatch outlast the GPU's forward and backward.
  const double host_excess = std::max(0.0, a * host + time.host_optimizer - a * gpu);
  out.compute_seconds = a * compute;
  out.fsdp_comm_seconds = a * time.fsdp_comm;
  out.tp_comm_seconds = a * tp_comm;
  out.ep_comm_seconds = a * ep_comm;
  out.cp_comm_seconds = a * cp_comm;
  out.exposed_comm_seconds = a * (edges + tp_comm + cp_comm + ep_comm + comm_excess);
  out.optimizer_seconds = time.optimizer;
  out.host_seconds = a * host + time.host_optimizer;
  out.overhead_seconds = a * contention + host_excess + time.optimizer;
  out.step_seconds = out.compute_seconds + out.exposed_comm_seconds + out.overhead_seconds;
}

// Under pipeline parallelism: a stage's forward (F) and backward, split into
// its input-gradient (I) and weight-gradient (W) parts for the zero-bubble
// schedules, each the GPU's time or eager PyTorch's dispatch, whichever is longer.
struct StageCosts {
  PipeCosts costs;
  double gpu = 0, exposed = 0;  // per micro-batch, F + I + W
};
StageCosts pipeline_stage_costs(const RunTerms& r, const StageShape& st, const StageTime& time) {
  const double m = static_cast<double>(r.m);
  const double copies = time.fsdp_mem / (2 * m);  // FSDP's copies spread over the micro-batches
  const double contention = r.collective_sm_fraction * time.cp_hidden;
  const double f_gpu = time.fwd + copies + contention / 2, b_gpu = time.bwd + copies + contention / 2;
  const double f_exp = time.tp_fwd + time.cp_fwd + time.ep_fwd + (st.head ? 0 : time.p2p);
  const double b_exp = time.tp_bwd + time.cp_bwd + time.ep_bwd + (st.embedding ? 0 : time.p2p);
  const double w_gpu = time.bwd_weight, i_gpu = b_gpu - w_gpu;
  // FSDP's hooks run once a step under PP (the groups stay gathered): their host time spread over the micro-batches.
  const double m_hooks = time.host_fsdp / (2 * m);
  const double f = std::max(f_gpu + f_exp, time.host_fwd + m_hooks);
  const double i = std::max(i_gpu + b_exp, (time.host_bwd + m_hooks) * i_gpu / b_gpu);
  const double w = std::max(w_gpu, (time.host_bwd + m_hooks) * w_gpu / b_gpu);
  StageCosts c;
  c.costs = PipeCosts{f, i, w};
  c.gpu = time.fwd + time.bwd + 2 * copies;
  c.exposed = f_exp + b_exp;
  return c;
}

// With pipeline parallelism: each micro-step's schedule simulated with every
// stage's F, I and W costs; the gradients are reduced only after its last
// micro-batch (nothing left to overlap), then the optimizer steps.
void pipeline_step(const RunTerms& r, const std::vector<StageShape>& shapes, const std::vector<StageTime>& times,
                   const std::vector<StageCosts>& costs, const PipeSchedule& schedule, GpuStepEstimate& out) {
  const GpuRunSpec& sp = r.sp;
  const double m = static_cast<double>(r.m), a = static_cast<double>(sp.grad_accum);
  std::vector<PipeCosts> stage_costs;
  for (const StageCosts& c : costs) stage_costs.push_back(c.costs);
  const PipeTimeline tl = simulate_pipeline_schedule(schedule, stage_costs);
  const int ranks = schedule.placement.ranks;
  // Per rank: its stages' communication tails, optimizer, first gather, and its share of the time.
  std::vector<double> tail(static_cast<size_t>(ranks), 0), first(static_cast<size_t>(ranks), 0),
      optimizer(static_cast<size_t>(ranks), 0), gpu(static_cast<size_t>(ranks), 0),
      exposed(static_cast<size_t>(ranks), 0), fsdp(static_cast<size_t>(ranks), 0), tp(static_cast<size_t>(ranks), 0),
      cp(static_cast<size_t>(ranks), 0), ep(static_cast<size_t>(ranks), 0);
  for (size_t si = 0; si < shapes.size(); ++si) {
    const size_t rk = static_cast<size_t>(schedule.placement.rank_of(static_cast<int>(si)));
    const StageTime& time = times[si];
    tail[rk] += time.rs + time.ar;
    optimizer[rk] += std::max(time.optimizer, time.host_optimizer);  // no backward left to hide it behind
    first[rk] = std::max(first[rk], time.first_group_ag);
    gpu[rk] += costs[si].gpu * m;
    exposed[rk] += costs[si].exposed * m;
    fsdp[rk] += time.fsdp_comm;
    tp[rk] += (time.tp_fwd + time.tp_bwd) * m;
    cp[rk] += (time.cp_fwd + time.cp_bwd) * m;
    ep[rk] += (time.ep_fwd + time.ep_bwd) * m;
  }
  double first_gather = 0, worst_tail = 0, worst_opt = 0;
  size_t busiest = 0;
  for (size_t rk = 0; rk < static_cast<size_t>(ranks); ++rk) {
    first_gather = std::max(first_gather, first[rk]);
    worst_tail = std::max(worst_tail, tail[rk]);
    worst_opt = std::max(worst_opt, optimizer[rk]);
    if (tl.busy[rk] > tl.busy[busiest]) busiest = rk;
  }
  const double bubble = tl.makespan - tl.busy[busiest];
  out.bubble_fraction = bubble / tl.makespan;
  out.compute_seconds = a * gpu[busiest];
  out.fsdp_comm_seconds = a * fsdp[busiest];
  out.tp_comm_seconds = a * tp[busiest];
  out.cp_comm_seconds = a * cp[busiest];
  out.ep_comm_seconds = a * ep[busiest];
  out.exposed_comm_seconds = a * (first_gather + exposed[busiest] + worst_tail);
  out.bubble_seconds = a * bubble;
  out.optimizer_seconds = worst_opt;
  // What the busiest rank's busy time holds beyond its kernels and exposed
  // collectives (host-bound actions, contention), then the optimizer.
  const double rest = tl.busy[busiest] - gpu[busiest] - exposed[busiest];
  out.overhead_seconds = a * std::max(0.0, rest) + worst_opt;
  out.step_seconds = a * (first_gather + tl.makespan + worst_tail) + worst_opt;
}

// One rank's memory from the stages it holds: their states, gathered weights
// and in-flight activations all at once (an upper bound: each stage's
// activations peak at a different moment), plus the largest of their
// transients; the streams' pools as the largest stage's.
GpuStageMemory rank_memory(int rank, const std::vector<StageMemory>& held) {
  if (held.size() == 1) {
    GpuStageMemory m = held[0].mem;
    m.stage = rank;
    return m;
  }
  GpuStageMemory m;
  m.stage = rank;
  double persistent = 0, transient = 0, compute_transient = 0;
  for (const StageMemory& s : held) {
    const GpuStageMemory& x = s.mem;
    m.layers += x.layers;
    m.has_embedding = m.has_embedding || x.has_embedding;
    m.has_head = m.has_head || x.has_head;
    m.in_flight = std::max(m.in_flight, x.in_flight);
    m.parameters += x.parameters;
    m.optimizer += x.optimizer;
    m.gradients += x.gradients;
    m.grad_accumulators += x.grad_accumulators;
    m.gathered_params += x.gathered_params;
    m.activations += x.activations;
    m.kept_outputs += x.kept_outputs;
    m.pp_buffers += x.pp_buffers;
    m.merged_outputs = std::max(m.merged_outputs, x.merged_outputs);
    m.allgather_pool = std::max(m.allgather_pool, x.allgather_pool);
    m.reduce_pool_extra = std::max(m.reduce_pool_extra, x.reduce_pool_extra);
    persistent += s.persistent;
    if (x.peak_allocated - s.persistent > transient) {
      transient = x.peak_allocated - s.persistent;
      m.peak_at = x.peak_at;
      m.working = x.working;
      m.loss_buffers = x.loss_buffers;
    }
    compute_transient = std::max(compute_transient, s.compute_reserved - s.persistent);
  }
  m.peak_allocated = persistent + transient;
  m.reserved = persistent + compute_transient + m.gradients + m.reduce_pool_extra + m.allgather_pool;
  return m;
}

// Where the estimate's rates came from, in words.
std::string rate_sources(const GpuHardware& hw, const GpuCalibration* cal, const RateUse& use) {
  auto count = [](size_t measured, size_t modelled, const char* what) {
    return std::to_string(measured) + " of " + std::to_string(measured + modelled) + " " + what + " priced by its timings";
  };
  if (cal == nullptr)
    return "published rates of " + hw.name + " (estimate/gpu_hardware.cpp); no calibration file";
  auto from = [](bool measured) { return measured ? "calibration" : "table"; };
  return "calibration " + cal->source + ": " + count(use.gemm_measured.size(), use.gemm_modelled.size(), "matrix-product shapes") + ", " +
         count(use.attention_measured.size(), use.attention_modelled.size(), "attention shapes") +
         (use.cp_chunks ? ", CP's attention chunks modelled" : "") + " (the rest modelled); peak matmul " +
         from(cal->matmul_flops.has_value()) + ", memory bandwidth " + from(cal->hbm_bandwidth.has_value()) +
         ", eager host costs " + std::to_string(cal->software.size()) + " of " +
         std::to_string(GpuCalibration::software_keys()) + " from the calibration";
}

}  // namespace

GpuStepEstimate estimate_gpu_run(const GpuRunSpec& sp, const GpuHardware& hw, const GpuCalibration* cal,
                                 PricedShapes* priced) {
  check_gpu_run(sp);
  RateUse use;
  const RunTerms r = run_terms(sp, hw, Rates{&hw, cal, priced, &use});
  const int P = static_cast<int>(sp.pp), m = static_cast<int>(r.m);
  // A schedule CSV fixes its own placement (and so the stages per rank); a
  // named schedule is built from the stages' costs (ZBVZeroBubble plans with them).
  PipeSchedule schedule;
  int V = 1;
  if (sp.pp > 1) {
    if (!sp.pp_schedule_csv.empty()) {
      schedule = read_pipeline_schedule_csv(sp.pp_schedule_csv, P, m);
      V = schedule.placement.stages() / P;
    } else {
      V = schedule_stages_per_rank(sp.pp_schedule, static_cast<int>(sp.pp_stages_per_rank));
    }
  }
  const std::vector<StageShape> shapes = split_stages(sp.model, sp.pp * V);
  std::vector<StageTime> times;
  std::vector<StageCosts> costs;
  for (const StageShape& st : shapes) {
    times.push_back(stage_time(r, st));
    costs.push_back(pipeline_stage_costs(r, st, times.back()));
  }
  std::vector<int> in_flight(shapes.size(), 1);
  if (sp.pp > 1) {
    if (sp.pp_schedule_csv.empty()) {
      std::vector<PipeCosts> c;
      for (const StageCosts& x : costs) c.push_back(x.costs);
      schedule = make_pipeline_schedule(sp.pp_schedule, P, V, m, c);
    }
    in_flight = stage_in_flight(schedule);
  }
  GpuStepEstimate out;
  std::vector<std::vector<StageMemory>> held(static_cast<size_t>(P));
  for (size_t si = 0; si < shapes.size(); ++si) {
    const int rank = sp.pp > 1 ? schedule.placement.rank_of(static_cast<int>(si)) : 0;
    held[static_cast<size_t>(rank)].push_back(stage_memory(r, shapes[si], static_cast<int>(si), in_flight[si]));
  }
  std::vector<double> stored(static_cast<size_t>(P), 0.0);  // each pipeline rank's FSDP shards of its stages
  for (size_t si = 0; si < shapes.size(); ++si) {
    const StageParams p = stage_params(r, shapes[si]);
    out.parameters_per_gpu = std::max(out.parameters_per_gpu, p.psi);
    const int rank = sp.pp > 1 ? schedule.placement.rank_of(static_cast<int>(si)) : 0;
    stored[static_cast<size_t>(rank)] += p.state / r.N;
  }
  out.parameters_stored_per_gpu = *std::max_element(stored.begin(), stored.end());
  for (int rank = 0; rank < P; ++rank) {
    out.stages.push_back(rank_memory(rank, held[static_cast<size_t>(rank)]));
    out.max_reserved = std::max(out.max_reserved, out.stages.back().reserved);
  }
  if (sp.pp == 1)
    single_stage_step(r, shapes[0], times[0], out);
  else
    pipeline_step(r, shapes, times, costs, schedule, out);

  const double local_tokens = static_cast<double>(sp.local_batch) * r.s;
  out.tokens_per_second_per_gpu = local_tokens / out.step_seconds / static_cast<double>(sp.cp * sp.tp * sp.pp);
  out.flops_per_token = torchtitan_flops_per_token(sp.model, sp.seq_len, sp.era);
  out.mfu = out.flops_per_token * out.tokens_per_second_per_gpu / hw.peak_bf16_flops;
  out.fits = out.max_reserved <= hw.hbm_bytes;
  out.rate_sources = rate_sources(hw, cal, use);
  return out;
}

double moe_layer_forward_seconds(const ModelArgs& a, double tokens, const GpuHardware& hw) {
  ANVIL_CHECK(a.moe(), a.name, "/", a.flavor, " has no mixture of experts");
  const Dims d = model_dims(a, 1);
  const Rates rt{&hw};
  const auto [gate, w13, w2] = ffn_products(rt, d, tokens, 1);
  return gate.fwd + 2 * w13.fwd + w2.fwd + rt.mem(moe_routing_bytes_per_token(d) * tokens);
}

}  // namespace anvil
