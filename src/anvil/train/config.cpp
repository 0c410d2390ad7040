#include "anvil/train/config.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>
#include <toml++/toml.h>
#include <variant>

#include "anvil/core/did_you_mean.h"
#include "anvil/core/error.h"

namespace anvil {

namespace {

using Target = std::variant<bool*, int64_t*, double*, std::string*>;

struct Key {
  std::string section;
  std::string name;
  Target target;
  std::string doc;
  std::vector<std::string> choices = {};  // strings: the allowed values (empty: any)
  double min = -std::numeric_limits<double>::infinity();
  double max = std::numeric_limits<double>::infinity();

  std::string full() const { return section + "." + name; }
};

constexpr double kInf = std::numeric_limits<double>::infinity();

// The one table of keys. Defaults are the JobConfig member initialisers.
std::vector<Key> key_table(JobConfig& c) {
  return {
      {"job", "dump_folder", &c.job.dump_folder, "folder for metrics.jsonl, checkpoints and traces"},
      {"job", "description", &c.job.description, "free text printed at start"},
      {"job", "device", &c.job.device,
       "where the job trains: cpu; cuda (one NVIDIA GPU, one process, dense models, causal attention); auto "
       "(cuda where this binary has CUDA and a GPU is visible, else cpu)",
       {"cpu", "cuda", "auto"}},

      {"model", "name", &c.model.name, "model family", {"llama2", "llama3", "qwen3"}},
      {"model", "flavor", &c.model.flavor,
       "named shape: debugmodel, 25M, 125M, 1B, 3B, 8B, 70B, 405B (llama3); 7B, 13B, 70B (llama2); "
       "debugmodel, 0.6B, 1.7B, 4B, 8B, 14B, 32B, and the mixtures of experts debugmodel_moe, 30B-A3B, "
       "235B-A22B (qwen3)"},
      {"model", "tokenizer_path", &c.model.tokenizer_path,
       "tokenizer.json (Hugging Face byte-level BPE) or tiktoken file; empty: byte-level tokenizer"},
      {"model",
       "attn_mask_type",
       &c.model.attn_mask_type,
       "block_causal: each token attends only to the earlier tokens of its own document (documents end at the "
       "tokenizer's EOS; torchtitan's default); causal: to every earlier token of the sequence, across documents",
       {"causal", "block_causal"}},
      {"model",
       "moe_routing",
       &c.model.moe_routing,
       "mixture-of-experts models: learned routes each token to its top k experts by the router; balanced "
       "routes the k slots of the token at position p of its sequence to experts (p·k + j) mod E whatever the router "
       "says (its weights still weight "
       "them), so every expert gets as many tokens: the case the dry run (anvil estimate, the fit check) takes, "
       "to check it against a real run",
       {"learned", "balanced"}},
      {"model",
       "moe_score_function",
       &c.model.moe_score_function,
       "mixture-of-experts models: the router's scores; softmax over the experts (Qwen3-MoE), or each expert's "
       "sigmoid (DeepSeek-V3); the chosen experts' scores weight their outputs, renormalised to sum to 1",
       {"softmax", "sigmoid"}},
      {"model",
       "moe_bias_update_rate",
       &c.model.moe_bias_update_rate,
       "mixture-of-experts models: the auxiliary-loss-free balance (DeepSeek-V3): each expert's bias, added to its "
       "score to choose experts but not to weight them, moves by this much after each step, up when the expert "
       "took fewer routes than the mean and down when more (DeepSeek-V3: 0.001); 0: no bias",
       {},
       0,
       kInf},
      {"model",
       "router_aux_loss_coef",
       &c.model.router_aux_loss_coef,
       "mixture-of-experts models: the load-balancing loss's coefficient; -1: the flavour's (Qwen3-MoE's 0.001)",
       {},
       -1,
       kInf},
      {"model",
       "moe_estimate_load",
       &c.model.moe_estimate_load,
       "mixture-of-experts models under expert parallelism: the routed tokens the dry run (anvil estimate, the fit "
       "check) has every rank's experts receive, as a multiple of the balanced share; 1: balanced. A learned "
       "routing's busiest rank sets the memory, so name the worst load to plan for it (docs/moe.md)",
       {},
       1,
       kInf},

      {"training",
       "dataset",
       &c.training.dataset,
       "text: text or JSON Lines files ({\"text\": ...}, optionally .gz), a folder or a glob (a plain text "
       "file is one document; the default is Shakespeare's works from scripts/prepare_data.sh); shards: a "
       "folder written by anvil tokenize; brown: the Brown corpus folder (tags stripped, every 20th file held "
       "out for validation)",
       {"text", "shards", "brown"}},
      {"training", "dataset_path", &c.training.dataset_path, "folder, file or glob the dataset is read from"},
      {"training", "steps", &c.training.steps, "optimizer steps to train", {}, 1, kInf},
      {"training",
       "local_batch_size",
       &c.training.local_batch_size,
       "sequences per micro-batch on each rank",
       {},
       1,
       kInf},
      {"training",
       "global_batch_size",
       &c.training.global_batch_size,
       "sequences per optimizer step over all ranks; a multiple of local_batch_size x data-parallel degree, "
       "the quotient being the gradient-accumulation steps; -1: no accumulation",
       {},
       -1,
       kInf},
      {"training", "seq_len", &c.training.seq_len, "tokens per sequence", {}, 1, kInf},
      {"training",
       "max_norm",
       &c.training.max_norm,
       "clip gradients to this global L2 norm; 0: no clipping",
       {},
       0,
       kInf},
      {"training",
       "mixed_precision_param",
       &c.training.mixed_precision_param,
       "compute dtype; bfloat16 keeps fp32 master weights and optimizer state",
       {"bfloat16", "float32"}},
      {"training", "seed", &c.training.seed, "seed of parameter initialisation and data order", {}, 0, kInf},
      {"training", "deterministic", &c.training.deterministic,
       "accepted for torchtitan compatibility: Anvil's kernels always reduce in a fixed order, so runs with "
       "the same seed, data and thread count are bitwise identical whatever this says"},
      {"training", "skip_nonfinite_steps", &c.training.skip_nonfinite_steps,
       "on a NaN/Inf loss or gradient skip the step instead of stopping"},

      {"optimizer", "name", &c.optimizer.name,
       "AdamW for every parameter; or Muon for the hidden matrices (optimizer.muon_params) and AdamW, with the keys "
       "below, for the rest (optimizer.adamw_params): docs/muon.md",
       {"AdamW", "Muon"}},
      {"optimizer", "lr", &c.optimizer.lr, "peak learning rate", {}, 0, kInf},
      {"optimizer", "beta1", &c.optimizer.beta1, "Adam beta1", {}, 0, 1},
      {"optimizer", "beta2", &c.optimizer.beta2, "Adam beta2", {}, 0, 1},
      {"optimizer", "eps", &c.optimizer.eps, "Adam epsilon", {}, 0, kInf},
      {"optimizer", "weight_decay", &c.optimizer.weight_decay, "decoupled weight decay", {}, 0, kInf},
      {"optimizer", "muon_lr", &c.optimizer.muon_lr, "Muon: peak learning rate (the schedule scales it as lr)", {}, 0,
       kInf},
      {"optimizer", "muon_weight_decay", &c.optimizer.muon_weight_decay,
       "Muon: decoupled weight decay, taken at the unadjusted learning rate as torch.optim.Muon does", {}, 0, kInf},
      {"optimizer", "muon_momentum", &c.optimizer.muon_momentum, "Muon: momentum", {}, 0, 1},
      {"optimizer", "muon_nesterov", &c.optimizer.muon_nesterov, "Muon: Nesterov momentum"},
      {"optimizer", "muon_ns_steps", &c.optimizer.muon_ns_steps, "Muon: Newton-Schulz iterations", {}, 1, 99},
      {"optimizer", "muon_eps", &c.optimizer.muon_eps,
       "Muon: Newton-Schulz divides by max(Frobenius norm, this)", {}, 0, kInf},
      {"optimizer", "muon_adjust_lr_fn", &c.optimizer.muon_adjust_lr_fn,
       "Muon: a matrix's learning rate, as torch.optim.Muon's: original, lr * sqrt(max(1, rows/cols)); "
       "match_rms_adamw, lr * 0.2 * sqrt(max(rows, cols))",
       {"original", "match_rms_adamw"}},
      {"optimizer", "muon_ns_dtype", &c.optimizer.muon_ns_dtype,
       "Muon: Newton-Schulz's products in bfloat16 (as torch.optim.Muon ships) or float32",
       {"bfloat16", "float32"}},
      {"optimizer", "muon_params", &c.optimizer.muon_params,
       "Muon: the parameters it updates, comma-separated glob patterns over Hugging Face names; each must be a "
       "matrix"},
      {"optimizer", "adamw_params", &c.optimizer.adamw_params,
       "Muon: the parameters AdamW updates beside it, comma-separated glob patterns; every parameter must match "
       "exactly one of the two lists"},

      {"lr_scheduler", "warmup_steps", &c.lr_scheduler.warmup_steps, "linear warm-up steps", {}, 0, kInf},
      {"lr_scheduler",
       "decay_ratio",
       &c.lr_scheduler.decay_ratio,
       "fraction of the steps spent decaying, at the end; -1: all steps after warm-up",
       {},
       -1,
       1},
      {"lr_scheduler", "decay_type", &c.lr_scheduler.decay_type, "shape of the decay", {"linear", "sqrt", "cosine"}},
      {"lr_scheduler", "min_lr_factor", &c.lr_scheduler.min_lr_factor, "final lr as a fraction of lr", {}, 0, 1},

      {"activation_checkpoint",
       "mode",
       &c.activation_checkpoint.mode,
       "activation checkpointing",
       {"none", "selective", "full"}},
      {"activation_checkpoint", "selective_ac_option", &c.activation_checkpoint.selective_ac_option,
       "with mode selective: 'op' keeps matmul and attention outputs and recomputes the rest; an integer k "
       "checkpoints every k-th block"},

      {"metrics", "log_freq", &c.metrics.log_freq, "log every this many steps", {}, 1, kInf},
      {"metrics", "verbose", &c.metrics.verbose,
       "the long step line: also TFLOP/s, memory by category, the data-loading share, elapsed time and, distributed, "
       "communication (metrics.jsonl holds every figure either way)"},
      {"metrics",
       "peak_tflops",
       &c.metrics.peak_tflops,
       "peak TFLOP/s of one process for MFU; 0: derive it from the measured clock and vector issue rates (`anvil "
       "info`)",
       {},
       0,
       kInf},
      {"metrics", "enable_tensorboard", &c.metrics.enable_tensorboard,
       "write TensorBoard scalar event files (loss, lr, grad norm, throughput, MFU, memory)"},
      {"metrics", "save_tb_folder", &c.metrics.save_tb_folder, "TensorBoard folder, inside dump_folder"},

      {"profiling", "enable_profiling", &c.profiling.enable_profiling,
       "write a Chrome trace (Perfetto, chrome://tracing) of the run's first step and every profile_freq-th"},
      {"profiling", "save_traces_folder", &c.profiling.save_traces_folder, "trace folder, inside dump_folder"},
      {"profiling", "profile_freq", &c.profiling.profile_freq, "profile every this many steps", {}, 1, kInf},
      {"profiling", "enable_memory_snapshot", &c.profiling.enable_memory_snapshot,
       "at the memory peak of the profiled steps, record the largest live tensors (always done when memory "
       "runs out)"},
      {"profiling", "save_memory_snapshot_folder", &c.profiling.save_memory_snapshot_folder,
       "memory snapshot folder, inside dump_folder"},
      {"profiling", "op_times", &c.profiling.op_times,
       "time every op (matrix products, attention, norms, the optimizer, copies) over the steps after the first "
       "and print a per-op table at the end (also op_times.md and op_times.json in dump_folder; rank 0's ops)"},
      {"profiling",
       "allocation_log_step",
       &c.profiling.allocation_log_step,
       "write every allocation and free of this step (its forward and backward, reductions and optimizer), in order, "
       "to "
       "allocations/rank-<r>.jsonl in dump_folder, on every rank: what `anvil estimate`'s dry run of that rank "
       "makes, event for event (0: off)",
       {},
       0,
       kInf},

      {"checkpoint", "enable", &c.checkpoint.enable, "save checkpoints"},
      {"checkpoint", "folder", &c.checkpoint.folder, "checkpoint folder, inside dump_folder"},
      {"checkpoint", "interval", &c.checkpoint.interval, "save every this many steps", {}, 1, kInf},
      {"checkpoint", "keep_latest_k", &c.checkpoint.keep_latest_k, "checkpoints kept; 0: all", {}, 0, kInf},
      {"checkpoint", "load_step", &c.checkpoint.load_step, "resume from this step; -1: the latest", {}, -1, kInf},
      {"checkpoint", "overwrite_newer", &c.checkpoint.overwrite_newer,
       "resume from an older step (load_step, or the newest complete one) although newer step folders exist: they "
       "are first renamed step-<N>.damaged-<time> or step-<N>.superseded-<time>, never deleted. Off: such a run is "
       "refused, and a damaged newest step stops the run"},
      {"checkpoint", "initial_load_path", &c.checkpoint.initial_load_path,
       "when the folder holds no checkpoint yet, start from the model weights in this Anvil step-N folder or "
       "Hugging Face folder (config.json + safetensors); the step, optimizer and data position start afresh"},
      {"checkpoint", "last_save_model_only", &c.checkpoint.last_save_model_only,
       "the final save holds only the model weights (in export_dtype), for export; it is not resumable"},
      {"checkpoint",
       "export_dtype",
       &c.checkpoint.export_dtype,
       "dtype of a model-only final save",
       {"float32", "bfloat16"}},
      {"checkpoint",
       "async_mode",
       &c.checkpoint.async_mode,
       "async: copy the state at the step, write it on a background thread while training goes on",
       {"disabled", "async"}},

      {"parallelism",
       "data_parallel_replicate_degree",
       &c.parallelism.data_parallel_replicate_degree,
       "DDP/HSDP replicas: ranks holding a whole copy (DDP) or a whole sharded copy (HSDP)",
       {},
       1,
       kInf},
      {"parallelism",
       "data_parallel_shard_degree",
       &c.parallelism.data_parallel_shard_degree,
       "FSDP (ZeRO-3) shards; -1: the ranks the other degrees leave over",
       {},
       -1,
       kInf},
      {"parallelism",
       "tensor_parallel_degree",
       &c.parallelism.tensor_parallel_degree,
       "tensor-parallel ranks",
       {},
       1,
       kInf},
      {"parallelism",
       "context_parallel_degree",
       &c.parallelism.context_parallel_degree,
       "context-parallel ranks: each holds 2 of the 2·degree chunks of every sequence (training.seq_len must "
       "divide into them); FSDP then shards over data_parallel_shard_degree x this (docs/context_parallel.md)",
       {},
       1,
       kInf},
      {"parallelism",
       "expert_parallel_degree",
       &c.parallelism.expert_parallel_degree,
       "mixture-of-experts models: consecutive data-parallel ranks the experts are split over, each holding "
       "num_experts / degree of every layer and exchanging routed tokens all-to-all with the others; under FSDP it "
       "divides data_parallel_shard_degree (each expert then sharded over shard_degree / degree ranks), under DDP it "
       "equals data_parallel_replicate_degree, as it must with tensor_parallel_degree > 1 (docs/moe.md)",
       {},
       1,
       kInf},
      {"parallelism",
       "context_parallel_load_balancer",
       &c.parallelism.context_parallel_load_balancer,
       "context parallel: headtail gives rank i chunks i and 2·degree−1−i (equal causal attention work); none "
       "gives it chunks 2i and 2i+1",
       {"headtail", "none"}},
      {"parallelism",
       "context_parallel_rotate_method",
       &c.parallelism.context_parallel_rotate_method,
       "context parallel: how the keys and values reach every rank; ring passes them rank to rank (two blocks "
       "held at a time, each transfer overlapping a block's attention); allgather gathers the whole sequences' "
       "keys and values for each layer (as fast on one host, more memory: docs/context_parallel.md)",
       {"allgather", "ring"}},
      {"parallelism",
       "pipeline_parallel_degree",
       &c.parallelism.pipeline_parallel_degree,
       "pipeline stages",
       {},
       1,
       kInf},
      {"parallelism",
       "pipeline_parallel_schedule",
       &c.parallelism.pipeline_parallel_schedule,
       "pipeline schedule (docs/pipeline.md); the looped ones run 2 stages per rank unless "
       "pipeline_parallel_layers_per_stage sets the stage count",
       {"GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble"}},
      {"parallelism", "pipeline_parallel_schedule_csv", &c.parallelism.pipeline_parallel_schedule_csv,
       "a CSV file of the pipeline schedule, one row of actions per rank (\"0F3\", \"1I0\", \"1W0\"), run instead "
       "of pipeline_parallel_schedule; empty: the named schedule"},
      {"parallelism",
       "pipeline_parallel_microbatch_size",
       &c.parallelism.pipeline_parallel_microbatch_size,
       "sequences per pipeline micro-batch",
       {},
       1,
       kInf},
      {"parallelism",
       "pipeline_parallel_layers_per_stage",
       &c.parallelism.pipeline_parallel_layers_per_stage,
       "blocks per pipeline stage, the embedding and the head counted as the next two keys say; the stage count "
       "it makes must be pipeline_parallel_degree times the schedule's stages per rank (-1: one stage per rank, "
       "two for the looped and V schedules)",
       {},
       -1,
       kInf},
      {"parallelism",
       "pipeline_parallel_first_stage_less_layers",
       &c.parallelism.pipeline_parallel_first_stage_less_layers,
       "blocks' worth the embedding counts for: the first stage holds this many blocks fewer",
       {},
       0,
       kInf},
      {"parallelism",
       "pipeline_parallel_last_stage_less_layers",
       &c.parallelism.pipeline_parallel_last_stage_less_layers,
       "blocks' worth the final norm and output head count for: the last stage holds this many blocks fewer",
       {},
       0,
       kInf},
      {"parallelism", "pipeline_parallel_auto_split", &c.parallelism.pipeline_parallel_auto_split,
       "cut the stages where estimated compute and memory balance (the embedding, the blocks and the head each "
       "priced; docs/pipeline.md) instead of by the layer counts of the keys above"},
      {"parallelism", "pipeline_parallel_keep_outputs", &c.parallelism.pipeline_parallel_keep_outputs,
       "diagnostic: the last stage keeps every micro-batch's logits until the step ends, as torchtitan did before "
       "PyTorch #159251 (seed 000), so its memory grows with the micro-batch count; off in any real run"},
      {"parallelism",
       "fsdp_reshard_after_forward",
       &c.parallelism.fsdp_reshard_after_forward,
       "FSDP: free a group's gathered weights after its forward (always), keep them until the backward "
       "(never: faster, more memory), or all but the last block's (default)",
       {"default", "always", "never"}},
      {"parallelism", "fsdp_single_rank", &c.parallelism.fsdp_single_rank,
       "GPU planner (anvil estimate --hardware): at data_parallel_shard_degree 1, model FSDP2 applied over "
       "one rank (bf16 weights gathered per block, 16 bytes per parameter) instead of torchtitan's bf16 "
       "autocast; Anvil's trainer does not shard over one rank and refuses it"},
      {"parallelism", "disable_loss_parallel", &c.parallelism.disable_loss_parallel,
       "tensor parallel: gather the logits instead of computing the loss over vocabulary shards"},
      {"parallelism", "enable_sequence_parallel", &c.parallelism.enable_sequence_parallel,
       "tensor parallel: shard the norms and residual stream over the sequence"},

      {"validation", "enable", &c.validation.enable, "evaluate on held-out data"},
      {"validation", "dataset_path", &c.validation.dataset_path,
       "held-out data in the training dataset's kind; empty: brown's own held-out split"},
      {"validation", "freq", &c.validation.freq, "evaluate every this many steps", {}, 1, kInf},
      {"validation", "steps", &c.validation.steps, "batches per evaluation", {}, 1, kInf},

      {"comm",
       "init_timeout_seconds",
       &c.comm.init_timeout_seconds,
       "deadline of every wait for other ranks (collective, send, receive) from start-up until the first step "
       "ends; on expiry the rank names the operation and the ranks and hosts it waited for, and ends the job. "
       "At least 1: a deadline cannot be turned off",
       {},
       1,
       kInf},
      {"comm",
       "train_timeout_seconds",
       &c.comm.train_timeout_seconds,
       "the same deadline after the first step; long enough for the slowest step, save or validation",
       {},
       1,
       kInf},
  };
}

std::string nearest_key(const std::vector<Key>& keys, const std::string& wanted) {
  std::string best;
  size_t best_d = std::numeric_limits<size_t>::max();
  const std::string wanted_key = wanted.substr(wanted.find('.') + 1);
  for (const Key& k : keys) {
    // A key in the wrong section is the likeliest slip: weigh the key name most.
    const size_t d = std::min(edit_distance(k.full(), wanted), edit_distance(k.name, wanted_key) + 1);
    if (d < best_d) best_d = d, best = k.full();
  }
  return best;
}

std::string type_name(const Target& t) {
  switch (t.index()) {
    case 0: return "boolean";
    case 1: return "integer";
    case 2: return "number";
    default: return "string";
  }
}

std::string value_str(const Target& t) {
  std::ostringstream out;
  std::visit(
      [&](auto* p) {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, bool>) out << (*p ? "true" : "false");
        else if constexpr (std::is_same_v<T, std::string>) out << '"' << *p << '"';
        else out << *p;
      },
      t);
  return out.str();
}

const Key& find_key(const std::vector<Key>& keys, const std::string& full, const std::string& where) {
  for (const Key& k : keys)
    if (k.full() == full) return k;
  throw Error(detail::concat(where, ": unknown key '", full, "'; did you mean '", nearest_key(keys, full),
                             "'? (anvil train --help lists every key)"));
}

// Range and choice checks, after the value is stored.
void check_value(const Key& k, const std::string& where) {
  if (auto* s = std::get_if<std::string*>(&k.target)) {
    if (!k.choices.empty() && std::find(k.choices.begin(), k.choices.end(), **s) == k.choices.end()) {
      std::string allowed;
      for (const auto& c : k.choices) allowed += (allowed.empty() ? "" : ", ") + c;
      throw Error(detail::concat(where, ": ", k.full(), " = \"", **s, "\" is not one of: ", allowed));
    }
    return;
  }
  double v = 0;
  if (auto* i = std::get_if<int64_t*>(&k.target)) v = static_cast<double>(**i);
  else if (auto* d = std::get_if<double*>(&k.target)) v = **d;
  else return;
  ANVIL_CHECK(std::isfinite(v) || std::isinf(k.max), where, ": ", k.full(), " must be finite");
  if (v < k.min || v > k.max) {
    std::ostringstream range;
    range << "[" << k.min << ", " << (std::isinf(k.max) ? std::string("inf") : detail::concat(k.max)) << "]";
    throw Error(detail::concat(where, ": ", k.full(), " = ", v, " is out of range ", range.str()));
  }
}

void set_from_toml(const Key& k, const toml::node& node, const std::string& where) {
  bool ok = false;
  std::visit(
      [&](auto* p) {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, bool>) {
          if (auto v = node.value_exact<bool>()) *p = *v, ok = true;
        } else if constexpr (std::is_same_v<T, int64_t>) {
          if (auto v = node.value_exact<int64_t>()) *p = *v, ok = true;
        } else if constexpr (std::is_same_v<T, double>) {
          if (node.is_integer() || node.is_floating_point()) *p = *node.value<double>(), ok = true;
        } else {
          if (auto v = node.value_exact<std::string>()) *p = *v, ok = true;
        }
      },
      k.target);
  ANVIL_CHECK(ok, where, ": ", k.full(), " must be of type ", type_name(k.target), " (default ", value_str(k.target), ")");
  check_value(k, where);
}

void set_from_string(const Key& k, const std::string& text, const std::string& where) {
  bool ok = true;
  std::visit(
      [&](auto* p) {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, bool>) {
          if (text == "true" || text == "1") *p = true;
          else if (text == "false" || text == "0") *p = false;
          else ok = false;
        } else if constexpr (std::is_same_v<T, int64_t>) {
          size_t used = 0;
          try {
            *p = std::stoll(text, &used);
          } catch (const std::exception&) {
            ok = false;
          }
          ok = ok && used == text.size();
        } else if constexpr (std::is_same_v<T, double>) {
          size_t used = 0;
          try {
            *p = std::stod(text, &used);
          } catch (const std::exception&) {
            ok = false;
          }
          ok = ok && used == text.size();
        } else {
          *p = text;
        }
      },
      k.target);
  ANVIL_CHECK(ok, where, ": ", k.full(), " must be of type ", type_name(k.target), ", got '", text, "'");
  check_value(k, where);
}

void apply_toml(std::vector<Key>& keys, const toml::table& root, const std::string& source) {
  for (const auto& [section_name, section] : root) {
    const std::string sec(section_name.str());
    const std::string where_sec = detail::concat(source, ":", section.source().begin.line);
    const toml::table* table = section.as_table();
    ANVIL_CHECK(table != nullptr, where_sec, ": '", sec, "' must be a [section] of keys");
    for (const auto& [key_name, node] : *table) {
      const std::string where = detail::concat(source, ":", node.source().begin.line);
      const Key& k = find_key(keys, sec + "." + std::string(key_name.str()), where);
      set_from_toml(k, node, where);
    }
  }
}

void apply_overrides(std::vector<Key>& keys, const std::vector<std::string>& args) {
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    ANVIL_CHECK(a.rfind("--", 0) == 0 && a.size() > 2, "command line: unexpected argument '", a,
                "'; overrides look like --section.key value");
    std::string name = a.substr(2), value;
    bool has_value = false;
    if (auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1), name = name.substr(0, eq), has_value = true;
    }
    if (name == "job.config_file") {  // consumed by parse_config
      if (!has_value) ++i;
      continue;
    }
    const std::string where = "command line --" + name;
    const Key& k = find_key(keys, name, where);
    if (!has_value) {
      const bool next_is_value = i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0;
      if (std::holds_alternative<bool*>(k.target) && !next_is_value) {
        value = "true";  // bare boolean flag
      } else {
        ANVIL_CHECK(next_is_value, where, ": missing value (", type_name(k.target), ")");
        value = args[++i];
      }
    }
    set_from_string(k, value, where);
  }
}

}  // namespace

JobConfig parse_config_text(const std::string& toml_text, const std::string& source_name,
                            const std::vector<std::string>& overrides) {
  JobConfig c;
  std::vector<Key> keys = key_table(c);
  if (!toml_text.empty()) {
    toml::table root;
    try {
      root = toml::parse(toml_text, source_name);
    } catch (const toml::parse_error& e) {
      throw Error(detail::concat(source_name, ":", e.source().begin.line, ": TOML syntax error: ", e.description()));
    }
    apply_toml(keys, root, source_name);
  }
  apply_overrides(keys, overrides);
  return c;
}

JobConfig parse_config(const std::vector<std::string>& args) {
  std::string file;
  std::vector<std::string> overrides;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--job.config_file") {
      ANVIL_CHECK(i + 1 < args.size(), "command line --job.config_file: missing path");
      file = args[++i];
    } else if (a.rfind("--job.config_file=", 0) == 0) {
      file = a.substr(18);
    } else if (i == 0 && a.size() > 5 && a.substr(a.size() - 5) == ".toml" && a.rfind("--", 0) != 0) {
      file = a;
    } else {
      overrides.push_back(a);
    }
  }
  std::string text;
  if (!file.empty()) {
    std::ifstream in(file);
    ANVIL_CHECK(in.good(), "cannot read config file '", file, "': ", std::strerror(errno),
                "; pass an existing .toml (see configs/)");
    std::stringstream ss;
    ss << in.rdbuf();
    text = ss.str();
  }
  return parse_config_text(text, file.empty() ? "<defaults>" : file, overrides);
}

std::string config_to_toml(const JobConfig& config) {
  JobConfig c = config;
  toml::table root;
  for (const Key& k : key_table(c)) {
    if (!root.contains(k.section)) root.insert(k.section, toml::table{});
    toml::table& t = *root[k.section].as_table();
    std::visit(
        [&](auto* p) {
          using T = std::remove_pointer_t<decltype(p)>;
          if constexpr (std::is_same_v<T, double>) {
            if (std::isfinite(*p)) t.insert(k.name, *p);
          } else {
            t.insert(k.name, *p);
          }
        },
        k.target);
  }
  std::ostringstream out;
  out << root << "\n";
  return out.str();
}

std::string config_help() {
  JobConfig c;
  std::ostringstream out;
  out << "configuration keys (booleans take true|false or stand bare: --training.deterministic), with defaults:\n";
  std::string section;
  for (const Key& k : key_table(c)) {
    if (k.section != section) out << "\n[" << (section = k.section) << "]\n";
    out << "  --" << k.full() << " (" << type_name(k.target) << ", default " << value_str(k.target) << ")\n      "
        << k.doc;
    if (!k.choices.empty()) {
      out << "; one of:";
      for (const auto& ch : k.choices) out << ' ' << ch;
    }
    out << "\n";
  }
  return out.str();
}

std::string config_markdown() {
  JobConfig c;
  std::ostringstream out;
  std::string section;
  for (const Key& k : key_table(c)) {
    if (k.section != section) {
      out << "\n## [" << (section = k.section) << "]\n\n| key | type | default | meaning |\n|---|---|---|---|\n";
    }
    out << "| `" << k.name << "` | " << type_name(k.target) << " | `" << value_str(k.target) << "` | " << k.doc;
    if (!k.choices.empty()) {
      out << " (one of:";
      for (const auto& ch : k.choices) out << " `" << ch << "`";
      out << ")";
    }
    out << " |\n";
  }
  return out.str();
}

DType compute_dtype(const JobConfig& config) {
  return config.training.mixed_precision_param == "bfloat16" ? DType::bf16 : DType::f32;
}

ModelArgs job_model_args(const JobConfig& config) {
  ModelArgs args = model_flavor(config.model.name, config.model.flavor);
  // A mixture-of-experts key on a dense model would change nothing: refused,
  // naming the keys, rather than ignored.
  if (!args.moe()) {
    const JobConfig::Model defaults;
    std::string set;
    const auto note = [&](bool changed, const char* key) {
      if (changed) set += detail::concat(set.empty() ? "" : ", ", "model.", key);
    };
    note(config.model.moe_routing != defaults.moe_routing, "moe_routing");
    note(config.model.moe_score_function != defaults.moe_score_function, "moe_score_function");
    note(config.model.moe_bias_update_rate != defaults.moe_bias_update_rate, "moe_bias_update_rate");
    note(config.model.router_aux_loss_coef != defaults.router_aux_loss_coef, "router_aux_loss_coef");
    note(config.model.moe_estimate_load != defaults.moe_estimate_load, "moe_estimate_load");
    ANVIL_CHECK(set.empty(), set, " set for ", config.model.name, "/", config.model.flavor,
                ", which has no mixture of experts; drop them, or pick a flavour with experts (qwen3/debugmodel_moe)");
  }
  args.moe_balanced_routing = config.model.moe_routing == "balanced";
  const double coef = config.model.router_aux_loss_coef;
  ANVIL_CHECK(coef == -1 || coef >= 0, "model.router_aux_loss_coef = ", coef,
              " must be -1 (the flavour's) or a coefficient >= 0");
  if (coef >= 0) args.router_aux_loss_coef = coef;
  args.moe_sigmoid_scores = config.model.moe_score_function == "sigmoid";
  args.moe_bias_update_rate = config.model.moe_bias_update_rate;
  return args;
}

AcPolicy activation_checkpoint_policy(const JobConfig& config) {
  const std::string& mode = config.activation_checkpoint.mode;
  const std::string& option = config.activation_checkpoint.selective_ac_option;
  if (mode == "none") return {AcMode::none, 1};
  if (mode == "full") return {AcMode::full, 1};
  ANVIL_CHECK(mode == "selective", "activation_checkpoint.mode = \"", mode, "\" is not one of: none, selective, full");
  if (option == "op") return {AcMode::selective_op, 1};
  int k = 0;
  try {
    size_t used = 0;
    k = std::stoi(option, &used);
    if (used != option.size()) k = 0;
  } catch (const std::exception&) {
    k = 0;
  }
  ANVIL_CHECK(k >= 1, "activation_checkpoint.selective_ac_option = \"", option,
              "\" must be \"op\" or a positive integer k (checkpoint every k-th block)");
  return {AcMode::selective_layer, k};
}

}  // namespace anvil
