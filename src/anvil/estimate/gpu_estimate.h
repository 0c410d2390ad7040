// The GPU-cluster planner's model: what a torchtitan-style run (PyTorch eager,
// FSDP2 with bf16 parameters gathered and fp32 gradients reduced, optional TP
// with sequence parallel, CP and PP, mixtures of experts with expert
// parallelism, the CUDA caching allocator) holds per GPU and
// how fast it steps, from published hardware figures and measured rates
// (estimate/gpu_hardware.h).
// Nothing in it is fitted to a measurement; docs/estimator.md derives each
// term and states the assumptions. This models torchtitan on GPUs, not
// Anvil's own CPU runs (estimate/memory.h does those).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "anvil/estimate/gpu_calibration.h"
#include "anvil/estimate/gpu_hardware.h"
#include "anvil/model/activation_checkpoint.h"
#include "anvil/model/args.h"

namespace anvil {

// The torchtitan/PyTorch version being modelled, where they differ in a way
// that changes the figures (read from torchtitan's source at those commits):
//   apr2024  torchtitan 395a526 / 1ea476e (April 2024, seed 001's table): the
//            model returns output(h).float(), fp32 logits; the FSDP2 of then
//            allocated the reduce-scatter input on the reduce-scatter stream;
//            MFU counted 6·N with the embedding (utils.get_num_flop_per_token).
//   v0_1_0   torchtitan v0.1.0 (July 2025, seed 000): bf16 logits, the loss
//            upcasts them (cross_entropy(pred.float())); reduce-scatter input
//            on the compute stream; MFU counts 6·(N − embedding)
//            (estimate/flops.h's flops_per_token).
enum class TorchtitanEra { apr2024, v0_1_0 };

struct GpuRunSpec {
  ModelArgs model;
  int64_t seq_len = 2048;
  int64_t local_batch = 1;  // sequences per data-parallel rank per step
  AcPolicy ac;
  // FSDP shard degree. At dp_shard x cp = 1 torchtitan applies no FSDP and
  // trains under bf16 autocast (maybe_enable_amp) on one GPU, unless
  // fsdp_single_rank asks for FSDP2 over that one rank (fully_shard on a mesh of one).
  int64_t dp_shard = 2;
  bool fsdp_single_rank = false;
  int64_t dp_replicate = 1;  // HSDP replicas
  int64_t tp = 1;            // tensor parallel, with sequence parallel and loss parallel
  // Context parallel: every sequence in 2·cp chunks, head-tail balanced; the
  // keys and values all-gathered over the cp group for each layer (PyTorch's
  // allgather rotation, torchtitan's default) or passed round a ring beside
  // the attention; FSDP shards over dp_shard × cp.
  int64_t cp = 1;
  std::string cp_rotate = "allgather";  // or "ring"
  int64_t pp = 1;
  // Expert parallelism (a mixture of experts): every block's experts split
  // over ep of the dp_shard × cp ranks (torchtitan borrows the EP group from
  // them), tokens exchanged by all-to-all; the experts FSDP-sharded over the
  // remaining dp_shard × cp / ep ranks in a group of their own.
  int64_t ep = 1;
  // Any schedule Anvil trains (pipeline/schedule.h): GPipe, 1F1B, Interleaved1F1B,
  // LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble; or a CSV file's.
  std::string pp_schedule = "1F1B";
  int64_t pp_stages_per_rank = 0;  // the looped schedules' stages per rank (0: their default, 2)
  std::string pp_schedule_csv;     // a schedule CSV (parallelism.pipeline_parallel_schedule_csv); wins over the name
  int64_t microbatch_size = 1;     // under PP: local_batch / (grad_accum · microbatch_size) micro-batches
  // Gradient accumulation: the local batch runs as grad_accum forward and
  // backward passes (FSDP gathers and reduce-scatters in each), one optimizer step.
  int64_t grad_accum = 1;
  // Seed 000's bug (PyTorch before PR #165822): the last stage appends every
  // micro-batch's output to output_chunks and concatenates them when the step ends.
  bool keep_pp_outputs = false;
  TorchtitanEra era = TorchtitanEra::v0_1_0;
  // Block-causal attention over documents of this many tokens on average
  // (flops.h's block_causal_share scales attention's time; FLOPs per token and
  // MFU stay torchtitan's); 0: the causal work (documents no shorter than a sequence).
  double mean_document_tokens = 0;
  // The optimizer: AdamW for every parameter (torchtitan's fused AdamW), or
  // Muon over the blocks' matrices (attention and feed-forward projections,
  // each expert's) with AdamW for the rest, as Anvil runs it (train/optimizer.h):
  // each matrix gathered to one owner rank of its shard × tp group,
  // orthogonalised whole with muon_ns_steps Newton-Schulz steps in bf16, its
  // update scattered back (docs/muon.md).
  bool muon = false;
  int64_t muon_ns_steps = 5;

  int64_t gpus() const { return dp_shard * dp_replicate * cp * tp * pp; }
  // One GPU without FSDP: fp32 parameters, gradients and AdamW state, each
  // weight cast to bf16 by autocast in the forward and kept for its backward.
  bool autocast() const { return dp_shard * cp == 1 && !fsdp_single_rank; }
  int64_t micro_batches() const { return pp > 1 ? local_batch / grad_accum / microbatch_size : 1; }
};

// One pipeline stage's memory per GPU, in bytes. The caching allocator is
// modelled as pools per CUDA stream (blocks freed on one stream are reused
// only by that stream, and cached memory is never returned while it fits):
// "reserved" = the compute stream's peak + the reduce-scatter stream's pool
// + the all-gather stream's pool (+ a fresh segment for a tensor larger than
// any cached block). docs/estimator.md states it in full.
struct GpuStageMemory {
  int stage = 0;
  int64_t layers = 0;
  bool has_embedding = false, has_head = false;
  int in_flight = 1;             // micro-batches whose activations the stage holds at once
  double parameters = 0;         // fp32 shards of the parameters (FSDP)
  double optimizer = 0;          // AdamW exp_avg and exp_avg_sq (Muon: one momentum per matrix element), fp32 shards
  double gradients = 0;          // fp32 gradient shards (reduce-scatter outputs: the reduce-scatter stream's pool)
  double grad_accumulators = 0;  // unsharded fp32 gradients FSDP accumulates while gradient sync is off (PP)
  double gathered_params = 0;    // bf16 unsharded parameters held at the peak
  double activations = 0;        // what the in-flight micro-batches keep for backward, at the peak
  double working = 0;            // the peak's transient: a block's recompute and backward, or a reduce-scatter input
  double loss_buffers = 0;       // logits and cross-entropy buffers, when the peak is the loss's backward
  double kept_outputs = 0;       // seed 000: every micro-batch's output kept until the step ends
  double merged_outputs = 0;     // ... and their concatenation, a new segment when no cached block holds it
  double pp_buffers = 0;         // receive buffers, one per micro-batch per stage boundary
  double allgather_pool = 0;     // the all-gather stream's cached flat buffers
  double reduce_pool_extra = 0;  // the reduce-scatter input when allocated on that stream (apr2024)
  double peak_allocated = 0;     // the most bytes allocated at once over all pools
  double reserved = 0;           // the prediction of torch.cuda.max_memory_reserved()
  std::string peak_at;           // which moment of the step the compute stream peaks in
};

// The step's time is the sum of four parts (the breakdown `anvil plan`
// prints): compute (the GPU's kernels), exposed communication, the pipeline
// bubble and overhead (collectives' SMs taken from compute, eager PyTorch's
// dispatch where it is slower than the GPU, the optimizer step).
struct GpuStepEstimate {
  std::vector<GpuStageMemory> stages;  // one per pipeline rank (one when pp == 1), with every stage it holds
  double parameters_per_gpu = 0;       // the largest pipeline stage's parameters, TP-split, its EP share of the experts
  double parameters_stored_per_gpu = 0;  // the most any GPU keeps: its FSDP shard of every stage it holds
  double max_reserved = 0;
  bool fits = false;                // every stage's reserved <= the GPU's memory
  double compute_seconds = 0;       // the GPU's kernels on the critical path (under PP: the busiest rank's)
  double fsdp_comm_seconds = 0;     // all-gathers, reduce-scatters (and HSDP all-reduce) per step
  double tp_comm_seconds = 0;       // TP's collectives (not overlapped)
  double cp_comm_seconds = 0;       // CP's key/value all-gathers and their gradients' reduce-scatters (not overlapped)
  double ep_comm_seconds = 0;       // expert parallelism's all-to-alls of tokens and their gradients (not overlapped)
  double exposed_comm_seconds = 0;  // communication that compute does not hide
  double optimizer_seconds = 0;     // (part of the overhead)
  double bubble_fraction = 0;       // PP: idle / makespan of the busiest rank under the schedule's simulation
  double bubble_seconds = 0;
  double overhead_seconds = 0;
  double host_seconds = 0;          // eager PyTorch's host time over the step (ops, autograd, FSDP2's hooks, optimizer)
  double step_seconds = 0;
  double tokens_per_second_per_gpu = 0;  // torchtitan's definition: local tokens / step / (cp · tp · pp)
  double flops_per_token = 0;            // the numerator MFU uses, per the era's definition
  double mfu = 0;                        // flops_per_token · tokens/s per GPU / peak
  std::string rate_sources;              // which rates priced it: the table's or a calibration file's
};

// Throws anvil::Error for a layout it does not model (naming the key). With
// `cal`, shapes it timed are priced by it (estimate/gpu_calibration.h); with
// `priced`, every shape priced is noted there.
GpuStepEstimate estimate_gpu_run(const GpuRunSpec& spec, const GpuHardware& hw, const GpuCalibration* cal = nullptr,
                                 PricedShapes* priced = nullptr);

// The FLOPs per token torchtitan's MFU uses in that era (see TorchtitanEra).
double torchtitan_flops_per_token(const ModelArgs& args, int64_t seq_len, TorchtitanEra era);

// One mixture-of-experts layer's forward on `tokens` tokens of one GPU,
// without expert parallelism, as a block prices it: the router's product, the
// experts' grouped products and the routing's memory passes (the layer-level
// check against a published measurement, docs/estimator.md).
double moe_layer_forward_seconds(const ModelArgs& args, double tokens, const GpuHardware& hw);

}  // namespace anvil
