// The published GPU runs the planner is checked against (seeds 000 and 001,
// and the published mixture-of-experts figures), each row's layout as a
// GpuRunSpec beside its published figures, and the
// markdown tables of predicted vs published that docs/estimator.md shows
// (`anvil plan --seeds`, bench/estimator_seeds.sh).
#pragma once
#include <string>
#include <vector>

#include "anvil/estimate/gpu_estimate.h"

namespace anvil {

// Seed 000 (PyTorch #159251): torchtitan v0.1.0, Llama 3 8B pruned to 16
// layers, FSDP 2 × PP 2 on 4 GPUs, 1F1B, seq 4096, AC full, micro-batches of
// one sequence (local batch = micro-batch count), torch's max reserved memory
// in GiB (torchtitan logs GiB) on rank 0 (stage 0) and rank 2 (last stage).
struct Seed000Row {
  bool keep_outputs;
  int micro_batches;
  double stage0_gib, last_gib;  // published
  GpuRunSpec spec;
};
std::vector<Seed000Row> seed000_rows();

// Seed 001 (torchtitan docs/performance.md, April 2024): FSDP2 on 64 A100-80GB,
// tokens/s per GPU (WPS) and MFU (%).
struct Seed001Row {
  std::string model;  // "llama3/8B"
  int batch;
  std::string ac;       // as the table writes it
  double wps, mfu_pct;  // published
  GpuRunSpec spec;
};
std::vector<Seed001Row> seed001_rows();
// The footnote: Llama 2 70B at local batch 2 under selective AC (layer and op)
// ran out of memory; batch 1 selective op and batch 2 full ran.
struct FootnoteRow {
  int batch;
  std::string ac;
  bool ran;  // published: true = it ran, false = out of memory
  GpuRunSpec spec;
};
std::vector<FootnoteRow> seed001_footnote_rows();

// A mixture-of-experts layer's forward with torch._grouped_mm on one H100
// (ByteDance-Seed/VeOmni PR #460, "Torch Fused MoE"): B=1, S=32768 tokens,
// H=2048, experts of width `ffn`, `top_k` of `experts` per token, in ms.
struct MoeLayerRow {
  int64_t experts, top_k, ffn;
  double tokens;
  double published_ms;
  ModelArgs args;  // Qwen3-30B-A3B's with the row's experts
};
std::vector<MoeLayerRow> moe_layer_rows();

// A published training run of a Qwen3-style mixture of experts on H100s
// (no torchtitan one with its configuration was found: docs/estimator.md).
struct MoeRunRow {
  std::string source;   // who ran it, with what
  double tokens_per_s;  // published, per GPU
  GpuRunSpec spec;      // its layout, as torchtitan would run it
};
std::vector<MoeRunRow> moe_run_rows();

// (predicted − published) / published.
double relative_error(double predicted, double published);

// The tables as markdown, every row with its error.
std::string seed_tables_markdown();

}  // namespace anvil
