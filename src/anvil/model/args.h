// Llama 2 / Llama 3 and Qwen3 model arguments and the named flavours, with the
// published shapes. Parameter counts follow from the shapes (see num_params).
// Qwen3 is Llama's block with two changes: a per-head RMSNorm on the queries
// and keys before RoPE (qk_norm), and a head_dim the config gives rather than
// dim ÷ n_heads (128 in every published size).
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "anvil/ops/rope.h"

namespace anvil {

struct ModelArgs {
  std::string name;    // model family: "llama2" | "llama3" | "qwen3"
  std::string flavor;  // "debugmodel", "8B", ...
  int64_t dim = 0;
  int64_t n_layers = 0;
  int64_t n_heads = 0;
  int64_t n_kv_heads = 0;
  int64_t vocab_size = 0;
  int64_t multiple_of = 256;
  std::optional<double> ffn_dim_multiplier;
  int64_t ffn_hidden_override = 0;  // 0: derive from dim, ffn_dim_multiplier and multiple_of
  double norm_eps = 1e-5;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;  // Llama 3.1-style long-context frequency scaling
  int64_t max_seq_len = 2048;
  bool tie_embeddings = false;
  int64_t head_dim_override = 0;  // 0: dim / n_heads (Llama); Qwen3 gives it
  bool qk_norm = false;           // Qwen3: RMSNorm over each query and key head (weights of head_dim), before RoPE
  // Mixture of experts (Qwen3-MoE: every block's feed-forward), off when 0:
  // num_experts experts of width moe_ffn_hidden, experts_per_token of them
  // per token, their weights renormalised to sum to 1 (norm_topk_prob).
  int64_t num_experts = 0;
  int64_t experts_per_token = 0;
  int64_t moe_ffn_hidden = 0;
  bool norm_topk_prob = true;
  // The load-balancing loss's coefficient (Hugging Face's router_aux_loss_coef; 0: none).
  double router_aux_loss_coef = 0.001;
  // Not architecture but a training mode: route by the forced-balance rule
  // (ops/moe_router.h) instead of the top k, the case a dry run takes.
  bool moe_balanced_routing = false;
  // DeepSeek-V3's router options (ops/moe_router.h): sigmoid scores instead
  // of the softmax, and the auxiliary-loss-free balance's bias, moved by this
  // much per step (0: no bias).
  bool moe_sigmoid_scores = false;
  double moe_bias_update_rate = 0.0;

  int64_t head_dim() const { return head_dim_override > 0 ? head_dim_override : dim / n_heads; }
  // Llama's rule: hidden = int(8·dim/3), times ffn_dim_multiplier, rounded up to multiple_of.
  int64_t ffn_hidden_dim() const;

  bool moe() const { return num_experts > 0; }

  int64_t params_per_layer() const;
  int64_t num_params() const;
  // The parameters one token's forward uses: all but the experts it is not
  // routed to (num_params() for a dense model).
  int64_t active_params() const;
  int64_t num_embedding_params() const { return vocab_size * dim; }

  // Throws anvil::Error naming the inconsistent field.
  void validate() const;
};

// The flavour `flavor` of family `name`; throws anvil::Error listing the known
// flavours when there is no such one.
ModelArgs model_flavor(const std::string& name, const std::string& flavor);
// "llama3/8B", ... for help texts and errors.
std::vector<std::string> known_flavors();

}  // namespace anvil
