// Hugging Face interop: a Llama, Qwen3 or Qwen3-MoE model's weights as a
// transformers `LlamaForCausalLM`, `Qwen3ForCausalLM` or `Qwen3MoeForCausalLM`
// folder (config.json + model.safetensors), written and read. A Qwen3-MoE
// folder's experts are one tensor per expert and projection
// (mlp.experts.E.gate_proj.weight ...), as Anvil names them; its
// router_aux_loss_coef is written but not compared on reading (it changes
// training, not the model: [model] router_aux_loss_coef sets it).
//
// Parameter names are Hugging Face's already (model/llama.h), so export and
// import map tensors one to one. No q_proj/k_proj permutation is needed either:
// Anvil's RoPE rotates halves (rotate_half), the convention of Hugging Face's
// LlamaAttention. Meta's original checkpoints rotate interleaved pairs
// (2i, 2i+1) and transformers' convert_llama_weights_to_hf.py permutes each
// head's q/k rows to turn one into the other; a Hugging Face folder therefore
// already holds the rows in the order Anvil's kernel uses
// (tests/convert_test.cpp checks the loss against PyTorch's rotate_half model).
#pragma once
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "anvil/core/tensor.h"
#include "anvil/model/args.h"
#include "anvil/model/params.h"

namespace anvil {

// Token ids config.json records when the tokenizer is known.
struct HfTokenIds {
  std::optional<int64_t> bos, eos;
};

// A config.json transformers' LlamaForCausalLM (Qwen3ForCausalLM or Qwen3MoeForCausalLM for qwen3) accepts for `args`, with
// torch_dtype naming export_dtype (f32 or bf16).
nlohmann::ordered_json hf_config_json(const ModelArgs& args, DType export_dtype, const HfTokenIds& token_ids = {});

// Checks that a config.json describes the same function as `args`: every
// field that changes the weights' shapes or the forward pass (sizes, heads,
// layers, vocabulary, norm eps, RoPE theta and scaling, tying, activation,
// biases). Missing fields take LlamaConfig's defaults. max_position_embeddings
// and torch_dtype are not compared: neither changes a weight or a result.
// Throws anvil::Error naming the first differing field, both values and
// `source` (the file).
void check_hf_config_matches(const nlohmann::json& config, const ModelArgs& args, const std::string& source);

struct HfExportOptions {
  DType dtype = DType::f32;  // f32, or bf16 rounded to nearest even
  HfTokenIds token_ids;
  // Further files written into the folder as they are (name, content), e.g.
  // tokenizer.json; they become visible together with the weights.
  std::vector<std::pair<std::string, std::string>> extra_files;
};

// What an export or import moved.
struct HfTransferStats {
  int64_t tensors = 0;
  uint64_t bytes = 0;                // tensor bytes written or read
  double seconds = 0;
  std::vector<std::string> ignored;  // import: tensors skipped (rotary inv_freq buffers)
};

// Writes out_dir/model.safetensors (every parameter by Hugging Face name, in
// `options.dtype`) and out_dir/config.json. Atomic as a folder: everything is
// written and fsynced in out_dir + ".tmp", which is then renamed to out_dir,
// so out_dir either does not exist or is complete. out_dir must not exist yet
// (an empty folder is replaced). `weights` must hold exactly the parameters of
// `args` (f32 or bf16, their shapes); throws anvil::Error naming the first one
// that is missing, extra or misshapen.
HfTransferStats export_hf(const std::map<std::string, Tensor>& weights, const ModelArgs& args,
                          const std::string& out_dir, const HfExportOptions& options);
// The same from a model's master weights.
HfTransferStats export_hf(const ParamStore& params, const ModelArgs& args, const std::string& out_dir,
                          const HfExportOptions& options);

// Reads a Hugging Face Llama or Qwen3 folder: config.json (checked against `args` with
// check_hf_config_matches), then model.safetensors, or
// model.safetensors.index.json and the shards it names. Tensors may be F32,
// BF16 or F16 and become f32; every parameter of `args` must be present with
// its shape. Rotary `inv_freq` buffers (older transformers saved them) are
// skipped and listed in `ignored`: Anvil derives them from rope_theta and
// rope_scaling. Any other tensor Anvil has no parameter for is an error,
// because dropping a weight would silently change the model. All names,
// dtypes and shapes are checked before any data is read. Errors name the file
// and the tensor.
HfTransferStats import_hf(const std::string& folder, const ModelArgs& args, ParamStore& params);
// The same into new f32 tensors by name (category parameters), without a ParamStore.
HfTransferStats import_hf(const std::string& folder, const ModelArgs& args, std::map<std::string, Tensor>& weights);

}  // namespace anvil
