#include "anvil/cli/convert_cmd.h"

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <sstream>

#include "anvil/cli/config_override.h"
#include "anvil/core/did_you_mean.h"
#include "anvil/core/durable_file.h"
#include "anvil/core/error.h"
#include "anvil/data/bpe_tokenizer.h"
#include "anvil/estimate/memory.h"
#include "anvil/model/hf_format.h"
#include "anvil/model/llama.h"
#include "anvil/train/checkpoint.h"
#include "anvil/train/model_source.h"

namespace fs = std::filesystem;

namespace anvil {

namespace {

constexpr const char* kUsage =
    "usage: anvil convert export CHECKPOINT OUT_DIR [--dtype float32|bfloat16] [--tokenizer PATH]\n"
    "                            [--section.key value ...]\n"
    "       anvil convert import HF_DIR OUT_DIR [--model.name N --model.flavor F]\n"
    "  Converts between Anvil checkpoints and Hugging Face folders, both ways, for each architecture Anvil\n"
    "  builds: Llama (LlamaForCausalLM: Llama 2 and 3), Qwen3 (Qwen3ForCausalLM) and Qwen3-MoE\n"
    "  (Qwen3MoeForCausalLM).\n"
    "  export  writes a Hugging Face folder (model.safetensors, config.json) from a checkpoint's master weights;\n"
    "          the model is the one the checkpoint's state.json records. CHECKPOINT is any checkpoint anvil\n"
    "          generate reads: a step-N folder, the checkpoint folder (its newest step), the job's dump folder, or\n"
    "          the job's CONFIG.toml with its --section.key overrides. OUT_DIR must not exist.\n"
    "    --dtype      float32 (default, exact) or bfloat16 (rounded to nearest even)\n"
    "    --tokenizer  a tokenizer.json to copy into the folder (with a tokenizer_config.json), or 'bytes'; its\n"
    "                 BOS/EOS ids go into config.json\n"
    "  import  reads a Hugging Face folder (config.json, model.safetensors or model.safetensors.index.json; F32,\n"
    "          BF16 or F16) and writes OUT_DIR/step-0/, a model-only checkpoint of f32 master weights (no\n"
    "          optimizer state or data position: a starting point, not a run to resume). The model is the Anvil\n"
    "          flavour config.json matches, as anvil generate finds it; --model.flavor (with --model.name,\n"
    "          default llama3) names it instead, and config.json is checked against it. See docs/checkpoint.md.\n\n"
    "examples:\n"
    "  anvil convert export outputs/checkpoint hf_model --dtype bfloat16 --tokenizer tokenizer.json\n"
    "  anvil convert export configs/debugmodel.toml hf_debugmodel\n"
    "  anvil convert import ~/models/Qwen3-0.6B qwen3_start\n"
    "  anvil convert import ~/models/Llama-3.2-1B llama_start --model.name llama3 --model.flavor 1B\n";

struct ParsedArgs {
  std::vector<std::string> positional;
  std::map<std::string, std::string> options;
  std::vector<std::string> config_overrides;  // --section.key value, for a CONFIG.toml source
};

ParsedArgs parse(const std::vector<std::string>& args, const std::vector<std::string>& allowed, bool config_overrides) {
  ParsedArgs out;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a.rfind("--", 0) != 0) {
      out.positional.push_back(a);
      continue;
    }
    bool known = false;
    for (const std::string& k : allowed) known = known || k == a;
    if (!known && config_overrides && take_config_override(args, i, out.config_overrides)) continue;
    ANVIL_CHECK(known, "anvil convert: unknown option '", a, "'\n", kUsage);
    ANVIL_CHECK(i + 1 < args.size(), "anvil convert: ", a, " needs a value\n", kUsage);
    out.options[a] = args[++i];
  }
  return out;
}

std::string option(const ParsedArgs& p, const std::string& key, const std::string& fallback) {
  auto it = p.options.find(key);
  return it == p.options.end() ? fallback : it->second;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The tokenizer's files for the export and its BOS/EOS ids for config.json.
void add_tokenizer(const std::string& path, const ModelArgs& args, HfExportOptions& opts) {
  const std::unique_ptr<Tokenizer> tok = load_tokenizer(path);
  ANVIL_CHECK(tok->vocab_size() <= args.vocab_size, "the tokenizer '", path, "' has ", tok->vocab_size(),
              " tokens but the model's vocabulary is ", args.vocab_size, "; it is not this model's tokenizer");
  if (tok->bos_id() >= 0) opts.token_ids.bos = tok->bos_id();
  if (tok->eos_id() >= 0) opts.token_ids.eos = tok->eos_id();
  if (path == "bytes") return;  // Hugging Face has no file for Anvil's byte-level tokenizer: ids only
  const std::string content = read_file(path);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(content);
  } catch (const nlohmann::json::exception&) {
    throw Error(detail::concat("'", path, "' is not a Hugging Face tokenizer.json (a tiktoken file cannot go into ",
                               "an export as it is)"));
  }
  opts.extra_files.emplace_back("tokenizer.json", content);
  // Without a tokenizer_config.json, AutoTokenizer would pick LlamaTokenizerFast
  // from config.json's model_type, whose defaults (a "<s>" BOS) need not exist here.
  nlohmann::ordered_json tc;
  tc["tokenizer_class"] = "PreTrainedTokenizerFast";
  tc["model_max_length"] = args.max_seq_len;
  for (const auto& t : j.value("added_tokens", nlohmann::json::array())) {
    if (opts.token_ids.bos && t.value("id", -1) == *opts.token_ids.bos) tc["bos_token"] = t.value("content", "");
    if (opts.token_ids.eos && t.value("id", -1) == *opts.token_ids.eos) tc["eos_token"] = t.value("content", "");
  }
  opts.extra_files.emplace_back("tokenizer_config.json", tc.dump(2) + "\n");
}

int export_command(const std::vector<std::string>& words) {
  const ParsedArgs p = parse(words, {"--dtype", "--tokenizer"}, true);
  ANVIL_CHECK(p.positional.size() == 2, "anvil convert export needs a checkpoint and an output folder\n", kUsage);
  const std::string& out_dir = p.positional[1];
  const std::string dtype = option(p, "--dtype", "float32");
  ANVIL_CHECK(dtype == "float32" || dtype == "bfloat16", "--dtype ", dtype, " is not float32 or bfloat16");
  // Before reading anything: the export never overwrites (export_hf checks again).
  ANVIL_CHECK(!fs::exists(out_dir) || (fs::is_directory(out_dir) && fs::is_empty(out_dir)), "'", out_dir,
              "' already exists; an export never overwrites: remove it or choose another folder");
  const auto t0 = std::chrono::steady_clock::now();

  // The checkpoint as anvil generate finds it: a step, a checkpoint or dump folder, a job's CONFIG.toml.
  const ModelSource src = find_model_source(model_source_path(p.positional[0], p.config_overrides));
  ANVIL_CHECK(src.kind == ModelSource::Kind::anvil_checkpoint, "'", src.path, "' is a Hugging Face folder already; ",
              "convert export reads an Anvil checkpoint (convert import makes one from it)");
  const std::string& step_dir = src.path;
  const CheckpointWeights ck = load_checkpoint_weights(step_dir);
  const ModelArgs& args = src.args;
  HfExportOptions opts;
  opts.dtype = dtype == "bfloat16" ? DType::bf16 : DType::f32;
  const std::string tokenizer = option(p, "--tokenizer", "");
  if (!tokenizer.empty()) add_tokenizer(tokenizer, args, opts);
  std::printf("anvil: exporting %s (%s/%s, step %lld, %lld parameters) to %s as %s\n", step_dir.c_str(),
              args.name.c_str(), args.flavor.c_str(), static_cast<long long>(ck.state.value("step", -1)),
              static_cast<long long>(args.num_params()), out_dir.c_str(), dtype.c_str());
  std::fflush(stdout);
  const HfTransferStats stats = export_hf(ck.tensors, args, out_dir, opts);
  std::string files = "model.safetensors, config.json";
  for (const auto& [name, content] : opts.extra_files) files += ", " + name;
  std::printf("anvil: wrote %s (%s): %lld tensors, %s of weights in %.2fs (%.2fs in all)\n", out_dir.c_str(),
              files.c_str(), static_cast<long long>(stats.tensors), human_bytes(stats.bytes).c_str(), stats.seconds,
              seconds_since(t0));
  return 0;
}

int import_command(const std::vector<std::string>& words) {
  const ParsedArgs p = parse(words, {"--model.flavor", "--model.name"}, false);
  ANVIL_CHECK(p.positional.size() == 2, "anvil convert import needs a Hugging Face folder and an output folder\n",
              kUsage);
  ANVIL_CHECK(p.options.count("--model.flavor") || !p.options.count("--model.name"), "anvil convert import: ",
              "--model.name needs --model.flavor (or give neither: the flavour config.json matches)\n", kUsage);
  const std::string& hf_dir = p.positional[0];
  const std::string& out_dir = p.positional[1];
  // The model as anvil generate finds it: the flavour config.json matches, or the one named (checked against it).
  const std::string named = p.options.count("--model.flavor")
                                ? option(p, "--model.name", "llama3") + "/" + option(p, "--model.flavor", "")
                                : "";
  const ModelSource src = find_model_source(hf_dir, named);
  ANVIL_CHECK(src.kind == ModelSource::Kind::hugging_face, "'", hf_dir, "' is an Anvil checkpoint, not a Hugging ",
              "Face folder (config.json and model.safetensors); convert export makes one from it");
  const ModelArgs& args = src.args;
  args.validate();
  ANVIL_CHECK(!fs::exists(fs::path(out_dir) / "step-0"), "'", (fs::path(out_dir) / "step-0").string(),
              "' already exists; remove it or choose another folder");
  const auto t0 = std::chrono::steady_clock::now();
  std::printf("anvil: importing %s as %s/%s (%lld parameters)\n", hf_dir.c_str(), args.name.c_str(),
              args.flavor.c_str(), static_cast<long long>(args.num_params()));
  std::fflush(stdout);
  std::map<std::string, Tensor> weights;
  const HfTransferStats stats = import_hf(hf_dir, args, weights);
  if (!stats.ignored.empty())
    std::printf("anvil: warning: skipped %zu tensors Anvil derives from config.json itself (first: %s)\n",
                stats.ignored.size(), stats.ignored[0].c_str());
  std::printf("anvil: read %lld tensors, %s in %.2fs\n", static_cast<long long>(stats.tensors),
              human_bytes(stats.bytes).c_str(), stats.seconds);
  std::vector<std::pair<std::string, Tensor>> ordered;
  for (const ParamSpec& s : llama_param_specs(args)) ordered.emplace_back(s.name, weights.at(s.name));
  const size_t bytes = save_model_only_checkpoint(out_dir, 0, ordered, args.name + "/" + args.flavor,
                                                  {{"source", fs::absolute(hf_dir).string()}});
  std::printf("anvil: wrote %s (model-only checkpoint, f32 master weights, %s) in %.2fs in all\n",
              (fs::path(out_dir) / "step-0").string().c_str(), human_bytes(bytes).c_str(), seconds_since(t0));
  return 0;
}

}  // namespace

int convert_command(const std::vector<std::string>& args) {
  for (const std::string& a : args)
    if (a == "--help" || a == "-h") {
      std::printf("%s", kUsage);
      return 0;
    }
  if (args.empty() || (args[0] != "export" && args[0] != "import")) {
    const std::string guess = args.empty() ? "" : nearest_word({"export", "import"}, args[0], 2);
    throw Error(detail::concat("anvil convert needs 'export' or 'import'",
                               guess.empty() ? "" : "; did you mean '" + guess + "'?", "\n", kUsage));
  }
  const std::vector<std::string> rest(args.begin() + 1, args.end());
  return args[0] == "export" ? export_command(rest) : import_command(rest);
}

}  // namespace anvil
