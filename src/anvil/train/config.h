// The job configuration: a TOML file, then command-line overrides
// (`--training.steps 10`), with torchtitan's section and key names. Every key is
// declared once, in config.cpp's table, with its type, default, allowed values
// and documentation; parsing, --help and docs/configuration.md all come from it.
#include <cstdint>
#include <string>
#include <vector>

#include "anvil/core/dtype.h"
#include "anvil/model/activation_checkpoint.h"
#include "anvil/model/args.h"

#pragma once

namespace anvil {

struct JobConfig {
  struct Job {
    std::string dump_folder = "./outputs";
    std::string description = "";
    // cpu until the one-call GPU check (bench/gpu/check.sh) has passed on a GPU; then auto.
    std::string device = "cpu";
  } job;
  struct Model {
    std::string name = "llama3";
    std::string flavor = "debugmodel";
    std::string tokenizer_path = "";
    std::string attn_mask_type = "block_causal";
    std::string moe_routing = "learned";
    std::string moe_score_function = "softmax";
    double moe_bias_update_rate = 0;   // the auxiliary-loss-free balance's step (DeepSeek-V3: 0.001); 0: off
    double router_aux_loss_coef = -1;  // -1: the flavour's (Qwen3-MoE: 0.001)
    double moe_estimate_load = 1.0;    // the dry run's tokens per expert-parallel rank, × the balanced share
  } model;
  struct Training {
    std::string dataset = "text";
    std::string dataset_path = "data/shakespeare/train";
    int64_t steps = 100;
    int64_t local_batch_size = 8;
    int64_t global_batch_size = -1;  // -1: local_batch_size · data-parallel degree (no accumulation)
    int64_t seq_len = 256;
    double max_norm = 1.0;
    std::string mixed_precision_param = "bfloat16";
    int64_t seed = 0;
    bool deterministic = false;
    bool skip_nonfinite_steps = false;
  } training;
  struct Optimizer {
    std::string name = "AdamW";
    double lr = 8e-4;
    double beta1 = 0.9;
    double beta2 = 0.95;
    double eps = 1e-8;
    double weight_decay = 0.1;
    // name = "Muon": the matrices muon_params names take Muon (ops/muon.h,
    // torch.optim.Muon's defaults), those adamw_params names AdamW with the
    // keys above (docs/muon.md). Comma-separated glob patterns over the
    // Hugging Face parameter names.
    double muon_lr = 1e-3;
    double muon_weight_decay = 0.1;
    double muon_momentum = 0.95;
    bool muon_nesterov = true;
    int64_t muon_ns_steps = 5;
    double muon_eps = 1e-7;
    std::string muon_adjust_lr_fn = "original";
    std::string muon_ns_dtype = "bfloat16";
    std::string muon_params = "model.layers.*.self_attn.*_proj.weight,model.layers.*.mlp.*_proj.weight";
    std::string adamw_params = "model.embed_tokens.weight,lm_head.weight,*norm.weight,model.layers.*.mlp.gate.weight";
  } optimizer;
  struct LrScheduler {
    int64_t warmup_steps = 10;
    double decay_ratio = -1;  // -1: decay over all steps after warm-up
    std::string decay_type = "linear";
    double min_lr_factor = 0.0;
  } lr_scheduler;
  struct ActivationCheckpoint {
    std::string mode = "none";
    std::string selective_ac_option = "2";
  } activation_checkpoint;
  struct Metrics {
    int64_t log_freq = 10;
    bool verbose = false;  // the long step line
    double peak_tflops = 0;  // 0: derive from the CPU's ISA, cores and clock
    bool enable_tensorboard = true;
    std::string save_tb_folder = "tb";
  } metrics;
  struct Profiling {
    bool enable_profiling = false;
    std::string save_traces_folder = "profile_traces";
    int64_t profile_freq = 10;
    bool enable_memory_snapshot = false;
    std::string save_memory_snapshot_folder = "memory_snapshot";
    bool op_times = false;
    int64_t allocation_log_step = 0;
  } profiling;
  struct Checkpoint {
    bool enable = false;
    std::string folder = "checkpoint";
    int64_t interval = 500;
    int64_t keep_latest_k = 2;
    int64_t load_step = -1;
    bool overwrite_newer = false;
    std::string initial_load_path = "";
    bool last_save_model_only = false;
    std::string export_dtype = "float32";
    std::string async_mode = "disabled";
  } checkpoint;
  struct Parallelism {
    int64_t data_parallel_replicate_degree = 1;
    int64_t data_parallel_shard_degree = -1;
    int64_t tensor_parallel_degree = 1;
    int64_t context_parallel_degree = 1;
    int64_t expert_parallel_degree = 1;
    std::string context_parallel_load_balancer = "headtail";
    std::string context_parallel_rotate_method = "ring";
    int64_t pipeline_parallel_degree = 1;
    std::string pipeline_parallel_schedule = "1F1B";
    std::string pipeline_parallel_schedule_csv;  // empty: the named schedule
    int64_t pipeline_parallel_microbatch_size = 1;
    bool pipeline_parallel_keep_outputs = false;
    int64_t pipeline_parallel_layers_per_stage = -1;
    bool pipeline_parallel_auto_split = false;
    int64_t pipeline_parallel_first_stage_less_layers = 1;
    int64_t pipeline_parallel_last_stage_less_layers = 1;
    std::string fsdp_reshard_after_forward = "default";
    bool fsdp_single_rank = false;  // the GPU planner: FSDP2 over one rank at shard degree 1 (else bf16 autocast)
    bool disable_loss_parallel = false;
    bool enable_sequence_parallel = true;
  } parallelism;
  struct Validation {
    bool enable = false;
    std::string dataset_path = "";  // empty: the dataset's own held-out split (brown)
    int64_t freq = 100;
    int64_t steps = 10;
  } validation;
  struct Comm {  // deadlines on every wait for other ranks (distributed/deadline.h)
    int64_t init_timeout_seconds = 300;
    int64_t train_timeout_seconds = 100;
  } comm;
};

// Parses `args` (after the subcommand): `--job.config_file PATH` (or a bare
// first argument ending in .toml) selects the TOML file; every other
// `--section.key value`, `--section.key=value` or bare boolean `--section.key`
// overrides it. Throws anvil::Error naming the key, where it came from
// (file:line or the flag), and the nearest valid key.
JobConfig parse_config(const std::vector<std::string>& args);
JobConfig parse_config_text(const std::string& toml_text, const std::string& source_name,
                            const std::vector<std::string>& overrides = {});

// Every key and its value, as TOML that parse_config_text reads back; saved
// with each checkpoint.
std::string config_to_toml(const JobConfig& config);

// What the model runs with, from the configuration: the compute dtype
// (training.mixed_precision_param) and the activation-checkpointing policy
// ([activation_checkpoint] mode and selective_ac_option: "op" or a positive
// integer k). Throws anvil::Error naming the key for a value it cannot use.
DType compute_dtype(const JobConfig& config);
// The model: [model] name and flavor, with the mixture-of-experts keys applied.
ModelArgs job_model_args(const JobConfig& config);
AcPolicy activation_checkpoint_policy(const JobConfig& config);

// Every key, its type, default and meaning: what `anvil train --help` and
// `anvil estimate --help` list after their own usage.
std::string config_help();
// The same table as Markdown, for docs/configuration.md.
std::string config_markdown();

}  // namespace anvil
