#include "anvil/model/hf_format.h"

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <set>

#include "anvil/core/durable_file.h"
#include "anvil/core/error.h"
#include "anvil/core/safetensors.h"
#include "anvil/model/llama.h"

namespace anvil {

namespace fs = std::filesystem;

namespace {

std::string model_label(const ModelArgs& a) { return a.name + "/" + a.flavor; }

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Compares config.json fields with the model's, in a fixed order, stopping at
// the first difference.
class ConfigCheck {
 public:
  ConfigCheck(const nlohmann::json& config, const ModelArgs& args, const std::string& source)
      : config_(config), args_(args), source_(source) {}

  // The field's value, nullptr when absent or null (both mean the config class's default).
  const nlohmann::json* find(const nlohmann::json& obj, const std::string& key) const {
    auto it = obj.find(key);
    return it == obj.end() || it->is_null() ? nullptr : &*it;
  }

  [[noreturn]] void differ(const std::string& field, const std::string& got, const std::string& want) const {
    throw Error(detail::concat("'", source_, "': ", field, " is ", got, " but ", model_label(args_), " has ", want,
                               "; the folder holds another model (pick the matching --model.name/--model.flavor)"));
  }

  const nlohmann::json& require(const nlohmann::json& obj, const std::string& key, const std::string& field) const {
    const nlohmann::json* v = find(obj, key);
    ANVIL_CHECK(v != nullptr, "'", source_, "' has no ", field, "; it is not a complete Llama config.json");
    return *v;
  }

  double number(const nlohmann::json& v, const std::string& field) const {
    ANVIL_CHECK(v.is_number(), "'", source_, "': ", field, " is ", v.dump(), ", not a number");
    return v.get<double>();
  }

  // An integer field; `fallback` is the config class's default when the field is absent.
  void integer(const std::string& key, int64_t want, std::optional<int64_t> fallback = std::nullopt,
               const nlohmann::json* obj = nullptr, const std::string& prefix = "") const {
    const nlohmann::json& o = obj ? *obj : config_;
    const std::string field = prefix + key;
    const nlohmann::json* v = find(o, key);
    if (!v && fallback) {
      if (*fallback != want) differ(field, detail::concat(*fallback, " (absent: the config class's default)"), std::to_string(want));
      return;
    }
    const double got = number(v ? *v : require(o, key, field), field);
    if (got != static_cast<double>(want)) differ(field, v ? v->dump() : "absent", std::to_string(want));
  }

  // A real field, equal to 1e-6 relative: Anvil keeps some of these in f32
  // (RoPE scaling), and a real difference (1e-5 against 1e-6) is far larger.
  void real(const std::string& key, double want, std::optional<double> fallback = std::nullopt,
            const nlohmann::json* obj = nullptr, const std::string& prefix = "") const {
    const nlohmann::json& o = obj ? *obj : config_;
    const std::string field = prefix + key;
    const nlohmann::json* v = find(o, key);
    const double got = v ? number(*v, field) : fallback ? *fallback : number(require(o, key, field), field);
    if (std::abs(got - want) > 1e-6 * std::abs(want))
      differ(field, v ? v->dump() : detail::concat(got, " (absent: the config class's default)"), nlohmann::json(want).dump());
  }

  void boolean(const std::string& key, bool want, bool fallback) const {
    const nlohmann::json* v = find(config_, key);
    if (v) ANVIL_CHECK(v->is_boolean(), "'", source_, "': ", key, " is ", v->dump(), ", not true or false");
    const bool got = v ? v->get<bool>() : fallback;
    if (got != want) differ(key, v ? v->dump() : detail::concat(fallback ? "true" : "false", " (absent)"), want ? "true" : "false");
  }

  void string(const std::string& key, const std::string& want, std::optional<std::string> fallback) const {
    const nlohmann::json* v = find(config_, key);
    if (v) ANVIL_CHECK(v->is_string(), "'", source_, "': ", key, " is ", v->dump(), ", not a string");
    const std::string got = v ? v->get<std::string>() : fallback ? *fallback : require(config_, key, key).get<std::string>();
    if (got != want) differ(key, "\"" + got + "\"", "\"" + want + "\"");
  }

  void rope_scaling() const {
    const RopeScaling& want = args_.rope_scaling;
    const nlohmann::json* rs = find(config_, "rope_scaling");
    std::string type = "default";
    if (rs) {
      ANVIL_CHECK(rs->is_object(), "'", source_, "': rope_scaling is ", rs->dump(), ", not an object or null");
      // transformers reads "rope_type", and "type" in configs written before 4.43.
      const nlohmann::json* t = find(*rs, "rope_type");
      if (!t) t = find(*rs, "type");
      ANVIL_CHECK(t && t->is_string(), "'", source_, "': rope_scaling has no rope_type");
      type = t->get<std::string>();
    }
    if (type != "default" && type != "llama3")
      throw Error(detail::concat("'", source_, "': rope_scaling.rope_type is \"", type,
                                 "\"; Anvil implements Llama 3.1's scaling (\"llama3\") only"));
    if ((type == "llama3") != want.enabled)
      differ("rope_scaling", rs ? rs->dump() : "null", hf_config_json(args_, DType::f32)["rope_scaling"].dump());
    if (!want.enabled) return;
    real("factor", want.factor, std::nullopt, rs, "rope_scaling.");
    real("low_freq_factor", want.low_freq_factor, std::nullopt, rs, "rope_scaling.");
    real("high_freq_factor", want.high_freq_factor, std::nullopt, rs, "rope_scaling.");
    integer("original_max_position_embeddings", want.original_max_position, std::nullopt, rs, "rope_scaling.");
  }

 private:
  const nlohmann::json& config_;
  const ModelArgs& args_;
  const std::string& source_;
};

// Where each tensor of a Hugging Face folder lives: one model.safetensors, or
// the shards a model.safetensors.index.json maps names to.
class HfWeightFiles {
 public:
  explicit HfWeightFiles(const fs::path& folder) {
    const fs::path single = folder / "model.safetensors", index = folder / "model.safetensors.index.json";
    if (fs::exists(single)) {
      open(single);
      for (const auto& [name, e] : readers_.begin()->second->entries()) where_.emplace(name, single.string());
      description_ = single.string();
      return;
    }
    if (!fs::exists(index)) {
      const bool bin = fs::exists(folder / "pytorch_model.bin") || fs::exists(folder / "pytorch_model.bin.index.json");
      throw Error(detail::concat("'", folder.string(), "' has neither model.safetensors nor ",
                                 "model.safetensors.index.json",
                                 bin ? "; PyTorch .bin weights are not read (save them as safetensors first)" : ""));
    }
    description_ = index.string();
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(std::ifstream(index));
    } catch (const nlohmann::json::exception& e) {
      throw Error(detail::concat("'", index.string(), "' is not valid JSON: ", e.what()));
    }
    ANVIL_CHECK(j.contains("weight_map") && j["weight_map"].is_object(), "'", index.string(),
                "' has no weight_map object; it is not a safetensors index");
    for (const auto& [name, shard] : j["weight_map"].items()) {
      ANVIL_CHECK(shard.is_string(), "'", index.string(), "': weight_map[\"", name, "\"] is not a file name");
      const fs::path file = folder / shard.get<std::string>();
      if (!readers_.count(file.string())) {
        ANVIL_CHECK(fs::exists(file), "'", index.string(), "' maps tensor '", name, "' to '", file.string(),
                    "', which does not exist");
        open(file);
      }
      ANVIL_CHECK(readers_.at(file.string())->entries().count(name), "'", index.string(), "' maps tensor '", name,
                  "' to '", file.string(), "', which has no such tensor");
      where_.emplace(name, file.string());
    }
  }

  // name -> file holding it
  const std::map<std::string, std::string>& where() const { return where_; }
  const std::string& description() const { return description_; }
  SafetensorsReader& reader_of(const std::string& name) { return *readers_.at(where_.at(name)); }

 private:
  void open(const fs::path& file) { readers_.emplace(file.string(), std::make_unique<SafetensorsReader>(file.string())); }

  std::map<std::string, std::unique_ptr<SafetensorsReader>> readers_;  // by file path
  std::map<std::string, std::string> where_;
  std::string description_;
};

bool is_rotary_buffer(const std::string& name) {
  const std::string suffix = "rotary_emb.inv_freq";
  return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Reads and checks a folder, then fills destination(i, spec) for every
// parameter i in llama_param_specs order.
HfTransferStats import_into(const std::string& folder, const ModelArgs& args,
                            const std::function<Tensor(size_t, const ParamSpec&)>& destination) {
  const auto t0 = std::chrono::steady_clock::now();
  const fs::path dir(folder);
  ANVIL_CHECK(fs::is_directory(dir), "'", folder, "' is not a folder; give the Hugging Face model folder");
  const fs::path config_path = dir / "config.json";
  ANVIL_CHECK(fs::exists(config_path), "'", folder, "' has no config.json; a Hugging Face model folder needs one");
  nlohmann::json config;
  try {
    config = nlohmann::json::parse(std::ifstream(config_path));
  } catch (const nlohmann::json::exception& e) {
    throw Error(detail::concat("'", config_path.string(), "' is not valid JSON: ", e.what()));
  }
  check_hf_config_matches(config, args, config_path.string());

  HfWeightFiles files(dir);
  const std::vector<ParamSpec> specs = llama_param_specs(args);
  std::set<std::string> expected;
  for (const ParamSpec& s : specs) {
    expected.insert(s.name);
    auto it = files.where().find(s.name);
    ANVIL_CHECK(it != files.where().end(), "'", files.description(), "' has no tensor '", s.name, "' (", shape_str(s.shape),
                "), which ", model_label(args), " needs");
    const SafetensorsEntry& e = files.reader_of(s.name).entries().at(s.name);
    ANVIL_CHECK(e.dtype == "F32" || e.dtype == "BF16" || e.dtype == "F16", "'", it->second, "': tensor '", s.name,
                "' is ", e.dtype, "; Anvil imports F32, BF16 and F16");
    ANVIL_CHECK(e.shape == s.shape, "'", it->second, "': tensor '", s.name, "' has shape ", shape_str(e.shape),
                " but ", model_label(args), " needs ", shape_str(s.shape));
  }
  HfTransferStats stats;
  std::vector<std::string> unexpected;
  for (const auto& [name, file] : files.where()) {
    if (expected.count(name)) continue;
    (is_rotary_buffer(name) ? stats.ignored : unexpected).push_back(name);
  }
  if (!unexpected.empty())
    throw Error(detail::concat("'", files.where().at(unexpected[0]), "': tensor '", unexpected[0],
                               "' is not a parameter of ", model_label(args), " (", unexpected.size(),
                               " such tensors); the folder holds another architecture or model"));

  for (size_t i = 0; i < specs.size(); ++i) {
    const ParamSpec& s = specs[i];
    SafetensorsReader& reader = files.reader_of(s.name);
    const SafetensorsEntry& e = reader.entries().at(s.name);
    Tensor dst = destination(i, s);
    ANVIL_ASSERT(dst.dtype() == DType::f32 && dst.shape() == s.shape);
    if (e.dtype == "F32") {
      reader.read(s.name, dst.raw());  // straight into place, no staging copy
    } else if (e.dtype == "BF16") {
      const Tensor staged = Tensor::empty(s.shape, DType::bf16, MemCategory::workspace, "import.bf16");
      reader.read(s.name, staged.raw());
      dst.copy_from(staged);
    } else {  // F16, which Tensor has no dtype for
      std::vector<uint16_t> staged(static_cast<size_t>(s.numel()));
      reader.read(s.name, staged.data());
      convert_f16_to_f32(staged.data(), dst.data<float>(), s.numel());
    }
    ++stats.tensors;
    stats.bytes += e.nbytes();
  }
  stats.seconds = seconds_since(t0);
  return stats;
}

// The families Anvil writes and reads: Llama, Qwen3 and Qwen3-MoE.
void check_hf_family(const ModelArgs& a) {
  ANVIL_CHECK(!a.moe() || a.name == "qwen3", model_label(a),
              " is a mixture of experts of a family other than Qwen3, which Anvil does not write or read");
  ANVIL_CHECK(!a.moe_sigmoid_scores && a.moe_bias_update_rate <= 0, model_label(a), " routes by ",
              a.moe_sigmoid_scores ? "sigmoid scores" : "softmax scores",
              a.moe_bias_update_rate > 0 ? " with expert biases" : "",
              " (model.moe_score_function, model.moe_bias_update_rate), which Hugging Face's Qwen3MoeForCausalLM "
              "cannot express (softmax scores, no biases): it would route other tokens to other experts, so it is "
              "not exported");
}

}  // namespace

nlohmann::ordered_json hf_config_json(const ModelArgs& a, DType export_dtype, const HfTokenIds& token_ids) {
  ANVIL_CHECK(export_dtype == DType::f32 || export_dtype == DType::bf16, "a Hugging Face export is float32 or bfloat16, not ",
              dtype_name(export_dtype));
  check_hf_family(a);
  nlohmann::ordered_json c;
  const bool qwen3 = a.name == "qwen3";
  c["architectures"] = {a.moe() ? "Qwen3MoeForCausalLM" : qwen3 ? "Qwen3ForCausalLM" : "LlamaForCausalLM"};
  c["model_type"] = a.moe() ? "qwen3_moe" : qwen3 ? "qwen3" : "llama";
  c["hidden_size"] = a.dim;
  c["intermediate_size"] = a.ffn_hidden_dim();  // a MoE's dense width: what its mlp_only_layers would use (none)
  c["num_attention_heads"] = a.n_heads;
  c["num_key_value_heads"] = a.n_kv_heads;
  c["num_hidden_layers"] = a.n_layers;
  c["head_dim"] = a.head_dim();
  c["vocab_size"] = a.vocab_size;
  c["max_position_embeddings"] = a.max_seq_len;
  c["rms_norm_eps"] = a.norm_eps;
  c["rope_theta"] = a.rope_theta;
  if (a.rope_scaling.enabled) {
    c["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", a.rope_scaling.factor},
                         {"low_freq_factor", a.rope_scaling.low_freq_factor},
                         {"high_freq_factor", a.rope_scaling.high_freq_factor},
                         {"original_max_position_embeddings", a.rope_scaling.original_max_position}};
  } else {
    c["rope_scaling"] = nullptr;
  }
  c["hidden_act"] = "silu";
  c["tie_word_embeddings"] = a.tie_embeddings;
  c["attention_bias"] = false;
  if (qwen3) {  // Qwen3Config's sliding window, which Anvil does not implement, off
    c["use_sliding_window"] = false;
    c["sliding_window"] = nullptr;
    c["max_window_layers"] = a.n_layers;
  } else {
    c["mlp_bias"] = false;
  }
  if (a.moe()) {  // every layer sparse (decoder_sparse_step 1, no mlp_only_layers), no shared expert
    c["num_experts"] = a.num_experts;
    c["num_experts_per_tok"] = a.experts_per_token;
    c["moe_intermediate_size"] = a.moe_ffn_hidden;
    c["norm_topk_prob"] = a.norm_topk_prob;
    c["decoder_sparse_step"] = 1;
    c["mlp_only_layers"] = nlohmann::ordered_json::array();
    c["router_aux_loss_coef"] = a.router_aux_loss_coef;
    c["output_router_logits"] = false;
  }
  c["initializer_range"] = 0.02;  // the std of Anvil's (torchtitan's) projection initialisation
  if (token_ids.bos) c["bos_token_id"] = *token_ids.bos;
  if (token_ids.eos) c["eos_token_id"] = *token_ids.eos;
  c["torch_dtype"] = export_dtype == DType::bf16 ? "bfloat16" : "float32";
  return c;
}

void check_hf_config_matches(const nlohmann::json& config, const ModelArgs& a, const std::string& source) {
  ANVIL_CHECK(config.is_object(), "'", source, "' is not a JSON object; it is not a config.json");
  check_hf_family(a);
  const ConfigCheck check(config, a, source);
  const bool qwen3 = a.name == "qwen3";
  check.string("model_type", a.moe() ? "qwen3_moe" : qwen3 ? "qwen3" : "llama", std::nullopt);
  check.integer("hidden_size", a.dim);
  check.integer("num_hidden_layers", a.n_layers);
  check.integer("num_attention_heads", a.n_heads);
  const nlohmann::json* heads = check.find(config, "num_attention_heads");
  check.integer("num_key_value_heads", a.n_kv_heads, heads->get<int64_t>());  // LlamaConfig: as many as query heads
  // LlamaConfig's default: hidden_size / num_attention_heads; Qwen3Config's: 128.
  check.integer("head_dim", a.head_dim(), qwen3 ? 128 : a.dim / a.n_heads);
  // A MoE's dense width shapes no weight when every layer is sparse (checked below).
  if (!a.moe()) check.integer("intermediate_size", a.ffn_hidden_dim());
  check.integer("vocab_size", a.vocab_size);
  check.real("rms_norm_eps", a.norm_eps, 1e-6);
  check.real("rope_theta", a.rope_theta, 10000.0);
  check.rope_scaling();
  check.boolean("tie_word_embeddings", a.tie_embeddings, false);
  check.string("hidden_act", "silu", "silu");
  check.boolean("attention_bias", false, false);
  check.boolean("mlp_bias", false, false);
  if (qwen3) check.boolean("use_sliding_window", false, false);
  if (a.moe()) {  // Qwen3MoeConfig's defaults when absent
    check.integer("num_experts", a.num_experts, 128);
    check.integer("num_experts_per_tok", a.experts_per_token, 8);
    check.integer("moe_intermediate_size", a.moe_ffn_hidden, 768);
    check.boolean("norm_topk_prob", a.norm_topk_prob, false);
    check.integer("decoder_sparse_step", 1, 1);
    const nlohmann::json* dense = check.find(config, "mlp_only_layers");
    ANVIL_CHECK(!dense || (dense->is_array() && dense->empty()), "'", source, "': mlp_only_layers is ",
                dense ? dense->dump() : "", ": dense layers among the experts' are not modelled (every layer of ",
                model_label(a), " is a mixture of experts)");
  }
}

HfTransferStats export_hf(const std::map<std::string, Tensor>& weights, const ModelArgs& args,
                          const std::string& out_dir, const HfExportOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  args.validate();
  const nlohmann::ordered_json config = hf_config_json(args, options.dtype, options.token_ids);
  const std::vector<ParamSpec> specs = llama_param_specs(args);
  std::set<std::string> expected;
  for (const ParamSpec& s : specs) {
    expected.insert(s.name);
    auto it = weights.find(s.name);
    ANVIL_CHECK(it != weights.end(), "the weights have no tensor '", s.name, "' (", shape_str(s.shape), "), which ",
                model_label(args), " needs; they come from another model");
    ANVIL_CHECK(it->second.shape() == s.shape && it->second.dtype() != DType::i32, "tensor '", s.name, "' is ",
                shape_str(it->second.shape()), " ", dtype_name(it->second.dtype()), " but ", model_label(args),
                " needs ", shape_str(s.shape), " f32; the weights come from another model");
  }
  for (const auto& [name, t] : weights)
    ANVIL_CHECK(expected.count(name), "tensor '", name, "' is not a parameter of ", model_label(args),
                "; the weights come from another model");
  for (const auto& [name, content] : options.extra_files)
    ANVIL_CHECK(name != "config.json" && name != "model.safetensors" && fs::path(name).filename() == name,
                "cannot add '", name, "' to an export: it must be a plain file name other than config.json and ",
                "model.safetensors");

  std::string out_str = out_dir;
  while (out_str.size() > 1 && out_str.back() == '/') out_str.pop_back();
  const fs::path out(out_str), tmp(out_str + ".tmp");
  std::error_code ec;
  const bool replace_empty = fs::is_directory(out, ec) && fs::is_empty(out, ec);
  ANVIL_CHECK(!fs::exists(out) || replace_empty, "'", out.string(),
              "' already exists; an export never overwrites: remove it or choose another folder");
  fs::remove_all(tmp, ec);
  fs::create_directories(tmp, ec);
  ANVIL_CHECK(!ec, "cannot create '", tmp.string(), "': ", ec.message());

  HfTransferStats stats;
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (const ParamSpec& s : specs) {
    const Tensor& w = weights.at(s.name);
    // bf16 rounds to nearest even (Tensor::to, as PyTorch's .to(torch.bfloat16)).
    tensors.emplace_back(s.name, w.dtype() == options.dtype ? w : w.to(options.dtype, MemCategory::workspace, s.name));
    ++stats.tensors;
    stats.bytes += tensors.back().second.nbytes();
  }
  // transformers refuses safetensors files whose metadata lacks format "pt".
  save_safetensors((tmp / "model.safetensors").string(), tensors, {{"format", "pt"}});
  tensors.clear();
  fsync_path(tmp / "model.safetensors", false);
  write_file_durably(tmp / "config.json", config.dump(2) + "\n");
  for (const auto& [name, content] : options.extra_files) write_file_durably(tmp / name, content);
  fsync_path(tmp, true);
  if (replace_empty) fs::remove(out, ec);
  fs::rename(tmp, out, ec);
  ANVIL_CHECK(!ec, "cannot rename '", tmp.string(), "' to '", out.string(), "': ", ec.message());
  fsync_path(out.has_parent_path() ? out.parent_path() : fs::path("."), true);
  stats.seconds = seconds_since(t0);
  return stats;
}

HfTransferStats export_hf(const ParamStore& params, const ModelArgs& args, const std::string& out_dir,
                          const HfExportOptions& options) {
  std::map<std::string, Tensor> weights;
  for (size_t i = 0; i < params.specs().size(); ++i)
    weights.emplace(params.specs()[i].name, params.master(static_cast<int>(i)));
  return export_hf(weights, args, out_dir, options);
}

HfTransferStats import_hf(const std::string& folder, const ModelArgs& args, ParamStore& params) {
  const std::vector<ParamSpec> specs = llama_param_specs(args);
  ANVIL_CHECK(params.specs().size() == specs.size(), "import_hf: the parameter store holds ", params.specs().size(),
              " parameters but ", model_label(args), " has ", specs.size());
  for (size_t i = 0; i < specs.size(); ++i)
    ANVIL_CHECK(params.specs()[i].name == specs[i].name && params.specs()[i].shape == specs[i].shape,
                "import_hf: the parameter store's '", params.specs()[i].name, "' does not match ", model_label(args));
  // Like ParamStore::init: the alignment padding between parameters is zero,
  // since the optimizer runs over the whole flat buffer.
  params.master_flat().zero_();
  HfTransferStats stats = import_into(folder, args, [&](size_t i, const ParamSpec&) {
    return params.master(static_cast<int>(i));
  });
  params.sync_compute_copy();
  return stats;
}

HfTransferStats import_hf(const std::string& folder, const ModelArgs& args, std::map<std::string, Tensor>& weights) {
  weights.clear();
  return import_into(folder, args, [&](size_t, const ParamSpec& s) {
    Tensor t = Tensor::empty(s.shape, DType::f32, MemCategory::parameters, s.name);
    weights.emplace(s.name, t);
    return t;
  });
}

}  // namespace anvil
