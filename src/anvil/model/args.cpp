#include "anvil/model/args.h"

#include <cctype>
#include <cmath>

#include "anvil/core/error.h"

namespace anvil {

int64_t ModelArgs::ffn_hidden_dim() const {
  if (ffn_hidden_override > 0) return ffn_hidden_override;
  int64_t hidden = 8 * dim / 3;
  if (ffn_dim_multiplier) hidden = static_cast<int64_t>(*ffn_dim_multiplier * static_cast<double>(hidden));
  return multiple_of * ((hidden + multiple_of - 1) / multiple_of);
}

int64_t ModelArgs::params_per_layer() const {
  const int64_t hd = head_dim();
  const int64_t attention = dim * (n_heads * hd) + 2 * dim * (n_kv_heads * hd) + (n_heads * hd) * dim;
  const int64_t feed_forward =
      moe() ? num_experts * dim /* router */ + num_experts * 3 * dim * moe_ffn_hidden : 3 * dim * ffn_hidden_dim();
  const int64_t norms = 2 * dim + (qk_norm ? 2 * hd : 0);
  return attention + feed_forward + norms;
}

int64_t ModelArgs::num_params() const {
  const int64_t embeddings = num_embedding_params();
  const int64_t output = tie_embeddings ? 0 : vocab_size * dim;
  return embeddings + n_layers * params_per_layer() + dim /* final norm */ + output;
}

int64_t ModelArgs::active_params() const {
  if (!moe()) return num_params();
  return num_params() - n_layers * (num_experts - experts_per_token) * 3 * dim * moe_ffn_hidden;
}

void ModelArgs::validate() const {
  const std::string where = "model " + name + "/" + flavor + ": ";
  ANVIL_CHECK(dim > 0 && n_layers > 0 && n_heads > 0 && vocab_size > 0, where,
              "dim, n_layers, n_heads and vocab_size must be positive");
  ANVIL_CHECK(head_dim_override > 0 || dim % n_heads == 0, where, "dim ", dim, " is not divisible by n_heads ",
              n_heads, " (give head_dim to set the heads' width apart from dim)");
  ANVIL_CHECK(head_dim_override >= 0, where, "head_dim must be positive (0: dim / n_heads)");
  ANVIL_CHECK(head_dim() % 2 == 0, where, "head_dim ", head_dim(), " must be even for RoPE");
  ANVIL_CHECK(n_kv_heads > 0 && n_heads % n_kv_heads == 0, where, "n_heads ", n_heads,
              " must be a multiple of n_kv_heads ", n_kv_heads);
  ANVIL_CHECK(multiple_of > 0, where, "multiple_of must be positive");
  ANVIL_CHECK(norm_eps > 0, where, "norm_eps must be positive");
  ANVIL_CHECK(rope_theta > 0, where, "rope_theta must be positive");
  ANVIL_CHECK(max_seq_len > 0, where, "max_seq_len must be positive");
  ANVIL_CHECK(num_experts >= 0, where, "num_experts must be 0 (dense) or positive");
  ANVIL_CHECK(!moe() || (experts_per_token >= 1 && experts_per_token <= num_experts && moe_ffn_hidden > 0), where,
              "a mixture of experts needs 1 <= experts_per_token (", experts_per_token, ") <= num_experts (",
              num_experts, ") and a positive moe_ffn_hidden (", moe_ffn_hidden, ")");
  // The experts of a projection are one (E, ·, ·) tensor of back-to-back
  // parameters, each padded to 64 bytes (model/params.h).
  ANVIL_CHECK(!moe() || moe_ffn_hidden * dim % 32 == 0, where, "moe_ffn_hidden (", moe_ffn_hidden, ") × dim (", dim,
              ") must be a multiple of 32");
  ANVIL_CHECK(router_aux_loss_coef >= 0, where, "router_aux_loss_coef must be 0 (none) or positive");
}

namespace {

ModelArgs llama3(std::string flavor, int64_t dim, int64_t layers, int64_t heads, int64_t kv_heads,
                 std::optional<double> mult, int64_t multiple_of) {
  ModelArgs a;
  a.name = "llama3";
  a.flavor = std::move(flavor);
  a.dim = dim, a.n_layers = layers, a.n_heads = heads, a.n_kv_heads = kv_heads;
  a.vocab_size = 128256;
  a.ffn_dim_multiplier = mult;
  a.multiple_of = multiple_of;
  a.rope_theta = 500000;
  a.max_seq_len = 131072;
  a.rope_scaling.enabled = true;  // Llama 3.1 / 3.2 long-context RoPE
  return a;
}

ModelArgs llama2(std::string flavor, int64_t dim, int64_t layers, int64_t heads, int64_t kv_heads,
                 std::optional<double> mult, int64_t multiple_of) {
  ModelArgs a;
  a.name = "llama2";
  a.flavor = std::move(flavor);
  a.dim = dim, a.n_layers = layers, a.n_heads = heads, a.n_kv_heads = kv_heads;
  a.vocab_size = 32000;
  a.ffn_dim_multiplier = mult;
  a.multiple_of = multiple_of;
  a.rope_theta = 10000;
  a.max_seq_len = 4096;
  return a;
}

// Qwen3 dense, as its config.json files give it: head_dim 128, RoPE θ 1e6,
// norm eps 1e-6, a 151,936-token vocabulary, the feed-forward width given
// (intermediate_size), 40,960 positions.
ModelArgs qwen3(std::string flavor, int64_t dim, int64_t layers, int64_t heads, int64_t kv_heads, int64_t ffn,
                bool tied) {
  ModelArgs a;
  a.name = "qwen3";
  a.flavor = std::move(flavor);
  a.dim = dim, a.n_layers = layers, a.n_heads = heads, a.n_kv_heads = kv_heads;
  a.vocab_size = 151936;
  a.ffn_hidden_override = ffn;
  a.head_dim_override = 128;
  a.qk_norm = true;
  a.norm_eps = 1e-6;
  a.rope_theta = 1000000;
  a.max_seq_len = 40960;
  a.tie_embeddings = tied;
  return a;
}

std::vector<ModelArgs> all_flavors() {
  std::vector<ModelArgs> out;
  {
    // torchtitan's debug model: small enough to train on a laptop in minutes.
    ModelArgs a;
    a.name = "llama3";
    a.flavor = "debugmodel";
    a.dim = 256, a.n_layers = 6, a.n_heads = 16, a.n_kv_heads = 16, a.vocab_size = 2048;
    a.multiple_of = 256;  // 8·256/3 = 682 → 768
    a.rope_theta = 500000;
    a.max_seq_len = 131072;  // Llama 3's context, as torchtitan's debug model keeps it
    out.push_back(a);
    // The debug model's blocks under Llama 3's 128,256-token vocabulary: the
    // shape where a micro-batch's logits outweigh everything else a pipeline
    // stage holds (seed 000's benchmark, bench/pipeline_seed000.sh).
    a.flavor = "debugmodel_128k";
    a.n_layers = 4, a.vocab_size = 128256;
    out.push_back(a);
  }
  {
    // CPU-sized flavours. 25M uses grouped-query attention (8 query heads over 4 KV heads).
    ModelArgs a;
    a.name = "llama3";
    a.flavor = "25M";
    a.dim = 512, a.n_layers = 6, a.n_heads = 8, a.n_kv_heads = 4, a.vocab_size = 8192;
    a.multiple_of = 256;  // 8·512/3 = 1365 → 1536
    a.rope_theta = 500000;
    // Llama 3's context: long-context (context-parallel) runs of a CPU-sized
    // model train sequences of 16K tokens and more.
    a.max_seq_len = 131072;
    out.push_back(a);
    a.flavor = "125M";
    a.dim = 768, a.n_layers = 12, a.n_heads = 12, a.n_kv_heads = 4, a.vocab_size = 32000;  // 8·768/3 = 2048
    out.push_back(a);
  }
  {
    ModelArgs a = llama3("1B", 2048, 16, 32, 8, 1.5, 256);
    a.tie_embeddings = true;
    a.rope_scaling.factor = 32;  // Llama 3.2
    out.push_back(a);
    a = llama3("3B", 3072, 28, 24, 8, 1.0, 256);
    a.tie_embeddings = true;
    a.rope_scaling.factor = 32;
    out.push_back(a);
  }
  out.push_back(llama3("8B", 4096, 32, 32, 8, 1.3, 1024));
  out.push_back(llama3("70B", 8192, 80, 64, 8, 1.3, 4096));
  out.push_back(llama3("405B", 16384, 126, 128, 8, 1.2, 4096));
  {
    // A debug Qwen3: the debug model's width and vocabulary with Qwen3's
    // attention (q/k norms; 8 query heads of 64 over 4 KV heads, so the heads'
    // width 512 is not dim).
    ModelArgs a = qwen3("debugmodel", 256, 6, 8, 4, 768, false);
    a.head_dim_override = 64;
    a.vocab_size = 2048;
    out.push_back(a);
  }
  {
    // Qwen3-MoE: every block's feed-forward a mixture of experts (no shared
    // expert), as published (the dense intermediate_size is unused), and a
    // debug flavour of 8 experts, 2 per token.
    ModelArgs a = qwen3("debugmodel_moe", 256, 6, 8, 4, 768, false);  // the debug Qwen3's attention
    a.head_dim_override = 64;
    a.vocab_size = 2048;
    a.num_experts = 8, a.experts_per_token = 2, a.moe_ffn_hidden = 128;
    out.push_back(a);
    a = qwen3("30B-A3B", 2048, 48, 32, 4, 6144, false);
    a.num_experts = 128, a.experts_per_token = 8, a.moe_ffn_hidden = 768;
    out.push_back(a);
    a = qwen3("235B-A22B", 4096, 94, 64, 4, 12288, false);
    a.num_experts = 128, a.experts_per_token = 8, a.moe_ffn_hidden = 1536;
    out.push_back(a);
  }
  out.push_back(qwen3("0.6B", 1024, 28, 16, 8, 3072, true));
  out.push_back(qwen3("1.7B", 2048, 28, 16, 8, 6144, true));
  out.push_back(qwen3("4B", 2560, 36, 32, 8, 9728, true));
  out.push_back(qwen3("8B", 4096, 36, 32, 8, 12288, false));
  out.push_back(qwen3("14B", 5120, 40, 40, 8, 17408, false));
  out.push_back(qwen3("32B", 5120, 64, 64, 8, 25600, false));
  out.push_back(llama2("7B", 4096, 32, 32, 32, std::nullopt, 256));
  out.push_back(llama2("13B", 5120, 40, 40, 40, std::nullopt, 256));
  out.push_back(llama2("70B", 8192, 80, 64, 8, 1.3, 4096));
  return out;
}

}  // namespace

ModelArgs model_flavor(const std::string& name, const std::string& flavor) {
  for (const ModelArgs& a : all_flavors())
    if (a.name == name && a.flavor == flavor) return a;
  // The commonest slip is the case ("8b" for "8B"): name the one meant.
  auto lower = [](std::string s) {
    for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return s;
  };
  for (const ModelArgs& a : all_flavors())
    if (lower(a.name) == lower(name) && lower(a.flavor) == lower(flavor))
      throw Error(detail::concat("unknown model '", name, "' flavor '", flavor, "'; did you mean '", a.name,
                                 "' flavor '", a.flavor, "'? Names and flavours are case-sensitive: set --model.name ",
                                 a.name, " --model.flavor ", a.flavor));
  std::string known;
  for (const std::string& k : known_flavors()) known += (known.empty() ? "" : ", ") + k;
  throw Error(detail::concat("unknown model '", name, "' flavor '", flavor, "'; known: ", known,
                             ". Set --model.name and --model.flavor to one of these"));
}

std::vector<std::string> known_flavors() {
  std::vector<std::string> out;
  for (const ModelArgs& a : all_flavors()) out.push_back(a.name + "/" + a.flavor);
  return out;
}

}  // namespace anvil
