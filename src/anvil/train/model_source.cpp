#include "anvil/train/model_source.h"

#include <filesystem>
#include <nlohmann/json.hpp>

#include "anvil/core/durable_file.h"
#include "anvil/core/error.h"
#include "anvil/data/bpe_tokenizer.h"
#include "anvil/model/hf_format.h"
#include "anvil/train/checkpoint.h"
#include "anvil/train/config.h"

namespace fs = std::filesystem;

namespace anvil {

namespace {

nlohmann::json read_json(const fs::path& p) {
  try {
    return nlohmann::json::parse(read_file(p));
  } catch (const nlohmann::json::exception& e) {
    throw Error(detail::concat("'", p.string(), "' is not valid JSON: ", e.what()));
  }
}

// The newest step-N inside a checkpoint folder that holds a state.json; in a
// job's dump folder, its checkpoint folder's (under the default name,
// checkpoint.folder = "checkpoint").
fs::path newest_step(const fs::path& folder) {
  int64_t best = -1;
  for (const fs::directory_entry& e : fs::directory_iterator(folder)) {
    const std::string name = e.path().filename().string();
    if (!e.is_directory() || name.rfind("step-", 0) != 0 || !fs::exists(e.path() / "state.json")) continue;
    try {
      best = std::max<int64_t>(best, std::stoll(name.substr(5)));
    } catch (const std::exception&) {
    }
  }
  if (best < 0 && fs::is_directory(folder / "checkpoint")) return newest_step(folder / "checkpoint");
  ANVIL_CHECK(best >= 0, "'", folder.string(), "' holds no complete checkpoint (a step-N folder with state.json, ",
              "or a dump folder's checkpoint/ of them), config.json (a Hugging Face model) or state.json (a step ",
              "folder)");
  return folder / ("step-" + std::to_string(best));
}

}  // namespace

ModelSource find_model_source(const std::string& path, const std::string& flavor) {
  ANVIL_CHECK(fs::exists(path), "'", path, "' is not a folder (it does not exist); give an Anvil checkpoint (a ",
              "step-N folder, the checkpoint folder holding them, or the job's dump folder) or a Hugging Face Llama, ",
              "Qwen3 or Qwen3-MoE folder");
  ANVIL_CHECK(fs::is_directory(path), "'", path, "' is a file; give an Anvil checkpoint folder or a Hugging Face ",
              "Llama or Qwen3 folder");
  ModelSource src;
  if (fs::exists(fs::path(path) / "config.json") && !fs::exists(fs::path(path) / "state.json")) {
    src.kind = ModelSource::Kind::hugging_face;
    src.path = path;
    const fs::path cfg_file = fs::path(path) / "config.json";
    const nlohmann::json cfg = read_json(cfg_file);
    if (!flavor.empty()) {
      const size_t slash = flavor.find('/');
      ANVIL_CHECK(slash != std::string::npos, "--model '", flavor, "' is not <name>/<flavor> (\"llama3/8B\")");
      src.args = model_flavor(flavor.substr(0, slash), flavor.substr(slash + 1));
      check_hf_config_matches(cfg, src.args, cfg_file.string());
      return src;
    }
    std::vector<std::string> matches;
    for (const std::string& name : known_flavors()) {
      const size_t slash = name.find('/');
      const ModelArgs a = model_flavor(name.substr(0, slash), name.substr(slash + 1));
      try {
        check_hf_config_matches(cfg, a, cfg_file.string());
        if (matches.empty()) src.args = a;
        matches.push_back(name);
      } catch (const Error&) {
      }
    }
    std::string known;
    for (const std::string& k : known_flavors()) known += (known.empty() ? "" : ", ") + k;
    ANVIL_CHECK(!matches.empty(), "'", cfg_file.string(), "' matches none of Anvil's flavours (", known,
                "), so its model cannot be built");
    return src;
  }
  src.path = fs::exists(fs::path(path) / "state.json") ? fs::path(path).string() : newest_step(path).string();
  const nlohmann::json state = read_json(fs::path(src.path) / "state.json");
  const std::string model = checkpoint_model(state);
  const size_t slash = model.find('/');
  ANVIL_CHECK(slash != std::string::npos && slash > 0 && slash + 1 < model.size(), "'", src.path,
              "/state.json' records no model (\"model\": \"<name>/<flavor>\")");
  src.args = model_flavor(model.substr(0, slash), model.substr(slash + 1));
  if (fs::exists(fs::path(src.path) / "config.toml")) {
    src.config_toml = read_file(fs::path(src.path) / "config.toml");
    // The router's options are the job's, not the flavour's.
    const ModelArgs job = job_model_args(parse_config_text(src.config_toml, src.path + "/config.toml"));
    src.args.moe_sigmoid_scores = job.moe_sigmoid_scores;
    src.args.moe_bias_update_rate = job.moe_bias_update_rate;
  }
  src.model_state = state.value("model_state", nlohmann::json());
  return src;
}

std::string model_source_path(const std::string& source, const std::vector<std::string>& overrides) {
  const bool toml = source.size() > 5 && source.substr(source.size() - 5) == ".toml";
  if (!toml) {
    ANVIL_CHECK(overrides.empty(), "unknown option '", overrides.empty() ? "" : overrides.front(),
                "' (configuration overrides go with a CONFIG.toml SOURCE)");
    return source;
  }
  std::vector<std::string> words = {source};
  words.insert(words.end(), overrides.begin(), overrides.end());
  const JobConfig cfg = parse_config(words);
  const std::string path = (fs::path(cfg.job.dump_folder) / cfg.checkpoint.folder).string();
  ANVIL_CHECK(fs::is_directory(path), "the job of ", source, " has saved no checkpoint yet ('", path,
              "' does not exist): train it first (checkpoint.enable = true)");
  return path;
}

nlohmann::json model_state_of(Llama& model) {
  if (model.args().moe_bias_update_rate <= 0) return nullptr;
  return {{"expert_bias", model.moe_state()->expert_bias}};
}

void apply_model_state(const nlohmann::json& state, Llama& model) {
  if (model.args().moe_bias_update_rate <= 0 || state.is_null() || !state.contains("expert_bias")) return;
  std::vector<float>& bias = model.moe_state()->expert_bias;
  const auto saved = state.at("expert_bias").get<std::vector<float>>();
  ANVIL_CHECK(saved.size() == bias.size(), "the checkpoint's expert biases are ", saved.size(),
              " values; this model has ", bias.size(), " (n_layers x num_experts)");
  std::copy(saved.begin(), saved.end(), bias.begin());  // in place: the blocks point into it
}

void load_model_weights(const ModelSource& source, ParamStore& params) {
  if (source.kind == ModelSource::Kind::hugging_face)
    import_hf(source.path, source.args, params);
  else
    load_checkpoint_model(source.path, params);
}

void load_model_weights(const std::string& path, const ModelArgs& args, ParamStore& params) {
  const ModelSource source = find_model_source(path, args.name + "/" + args.flavor);
  ANVIL_CHECK(source.args.name == args.name && source.args.flavor == args.flavor, "'", source.path, "' holds a ",
              source.args.name, "/", source.args.flavor, " model, not ", args.name, "/", args.flavor);
  load_model_weights(source, params);
}

std::unique_ptr<Tokenizer> model_source_tokenizer(const ModelSource& source, const std::string& override_path) {
  std::string path = override_path;
  if (path.empty() && source.kind == ModelSource::Kind::hugging_face) {
    path = (fs::path(source.path) / "tokenizer.json").string();
    ANVIL_CHECK(fs::exists(path), "'", source.path, "' has no tokenizer.json; pass --tokenizer PATH (a ",
                "tokenizer.json, a tiktoken file or 'bytes')");
  }
  if (path.empty()) {
    ANVIL_CHECK(!source.config_toml.empty(), "'", source.path, "' holds no config.toml naming its tokenizer; pass ",
                "--tokenizer PATH");
    const JobConfig cfg = parse_config_text(source.config_toml, source.path + "/config.toml");
    path = cfg.model.tokenizer_path.empty() ? "bytes" : cfg.model.tokenizer_path;
    ANVIL_CHECK(
        path == "bytes" || fs::exists(path), "the checkpoint was trained with the tokenizer '", path,
        "' (its config.toml), which is not here; run from the folder it was trained in or pass --tokenizer PATH");
  }
  std::unique_ptr<Tokenizer> tok = load_tokenizer(path);
  ANVIL_CHECK(tok->vocab_size() <= source.args.vocab_size, "the tokenizer '", path, "' has ", tok->vocab_size(),
              " tokens but ", source.args.name, "/", source.args.flavor, "'s vocabulary is ", source.args.vocab_size,
              ": it is not this model's tokenizer; pass the one it was trained with (--tokenizer PATH)");
  return tok;
}

}  // namespace anvil
