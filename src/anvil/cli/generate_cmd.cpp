#include "anvil/cli/generate_cmd.h"

#include <cstdio>
#include <iostream>
#include <iterator>
#include <memory>

#include "anvil/cli/config_override.h"
#include "anvil/cli/count_arg.h"
#include "anvil/core/error.h"
#include "anvil/core/free_cores.h"
#include "anvil/generate/generator.h"
#include "anvil/model/llama.h"
#include "anvil/train/model_source.h"

namespace anvil {

namespace {

constexpr const char* kUsage =
    "usage: anvil generate SOURCE --prompt TEXT [--prompt TEXT ...] [options]\n"
    "  Continues each prompt with a model: the prompt in one pass, then one token per step from a key/value\n"
    "  cache. One prompt streams its text as it comes; several decode as a batch and print when done. Speed\n"
    "  (prompt and generated tokens/s) goes to stderr.\n"
    "  SOURCE            an Anvil checkpoint: a step-N folder, the checkpoint folder (its newest step) or the\n"
    "                    job's dump folder (its checkpoint/'s newest step); a Hugging Face Llama, Qwen3 or\n"
    "                    Qwen3-MoE folder (config.json, model.safetensors); or a job's CONFIG.toml with its\n"
    "                    --section.key overrides: the newest checkpoint that job saved\n"
    "  --prompt TEXT     a prompt ('-' reads it from stdin); repeat for a batch\n"
    "  --max_new_tokens  tokens to generate per prompt (default 64; fewer at EOS or the model's context)\n"
    "  --temperature T   softmax temperature (default 0.8; 0 is greedy)\n"
    "  --top_k K         sample among the K most likely tokens (default 0: all; 1 is greedy)\n"
    "  --top_p P         sample among the most likely tokens whose probability reaches P (default 1: all)\n"
    "  --seed S          the sampling seed (default 0): the same seed gives the same text\n"
    "  --dtype D         bf16 (default) or fp32 compute\n"
    "  --tokenizer PATH  the tokenizer (default: the checkpoint's job tokenizer, or the folder's tokenizer.json)\n"
    "  --model N/F       a Hugging Face folder's model, e.g. llama3/8B (default: the flavour config.json matches)\n\n"
    "examples:\n"
    "  anvil generate outputs/checkpoint --prompt 'Once upon a time' --max_new_tokens 100\n"
    "  anvil generate configs/debugmodel.toml --prompt 'The' --prompt 'A' --temperature 0\n"
    "  anvil generate ~/models/Llama-3.2-1B --prompt 'The capital of France is' --top_p 0.9\n";

double number(const std::string& flag, const std::string& value) {
  try {
    size_t used = 0;
    const double x = std::stod(value, &used);
    if (used == value.size()) return x;
  } catch (const std::exception&) {
  }
  throw Error(detail::concat("anvil generate: ", flag, " '", value, "' is not a number\n", kUsage));
}

std::string read_stdin() {
  std::string text((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.pop_back();
  return text;
}

}  // namespace

size_t complete_utf8_prefix(const std::string& text) {
  // Walk back over at most 3 continuation bytes to the last lead byte; keep it
  // only if its sequence is complete.
  size_t i = text.size(), back = 0;
  while (i > 0 && back < 4 && (static_cast<unsigned char>(text[i - 1]) & 0xC0) == 0x80) --i, ++back;
  if (i == 0) return back == 0 ? 0 : text.size();  // only continuation bytes: nothing to wait for
  const unsigned char lead = static_cast<unsigned char>(text[i - 1]);
  const size_t need = lead < 0x80 ? 1 : (lead >> 5) == 0x6 ? 2 : (lead >> 4) == 0xE ? 3 : (lead >> 3) == 0x1E ? 4 : 1;
  return back + 1 >= need ? text.size() : i - 1;
}

int generate_command(const std::vector<std::string>& args) {
  std::vector<std::string> prompts, overrides;
  std::string source_arg, dtype = "bf16", tokenizer, model;
  GenerateOptions opts;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      std::printf("%s", kUsage);
      return 0;
    }
    if (a.rfind("--", 0) != 0) {
      ANVIL_CHECK(source_arg.empty(), "anvil generate: one SOURCE, not '", source_arg, "' and '", a, "'\n", kUsage);
      source_arg = a;
      continue;
    }
    const bool ours = a == "--prompt" || a == "--max_new_tokens" || a == "--temperature" || a == "--top_k" ||
                      a == "--top_p" || a == "--seed" || a == "--dtype" || a == "--tokenizer" || a == "--model";
    if (!ours) {  // a job configuration's --section.key [value]
      ANVIL_CHECK(take_config_override(args, i, overrides), "anvil generate: unknown option '", a, "'\n", kUsage);
      continue;
    }
    ANVIL_CHECK(i + 1 < args.size(), "anvil generate: ", a, " needs a value\n", kUsage);
    const std::string& v = args[++i];
    if (a == "--prompt")
      prompts.push_back(v == "-" ? read_stdin() : v);
    else if (a == "--max_new_tokens")
      opts.max_new_tokens = parse_count_arg("anvil generate", a, v);
    else if (a == "--temperature")
      opts.sampling.temperature = static_cast<float>(number(a, v));
    else if (a == "--top_k")
      opts.sampling.top_k = parse_count_arg("anvil generate", a, v, 0);
    else if (a == "--top_p")
      opts.sampling.top_p = static_cast<float>(number(a, v));
    else if (a == "--seed")
      opts.sampling.seed = static_cast<uint64_t>(parse_count_arg("anvil generate", a, v, 0));
    else if (a == "--dtype")
      dtype = v;
    else if (a == "--tokenizer")
      tokenizer = v;
    else if (a == "--model")
      model = v;
  }
  ANVIL_CHECK(!source_arg.empty(), "anvil generate needs a SOURCE (a checkpoint, a Hugging Face folder or a job's ",
              "CONFIG.toml)\n", kUsage);
  ANVIL_CHECK(!prompts.empty(), "anvil generate needs at least one --prompt\n", kUsage);
  ANVIL_CHECK(dtype == "bf16" || dtype == "fp32", "anvil generate: --dtype ", dtype, " is not bf16 or fp32");
  check_sampling_options(opts.sampling);  // before anything is loaded or printed
  // A job's CONFIG.toml stands for the checkpoints it saved.
  // Decoding runs many small parallel regions: a thread beside a busy process would stall every one.
  if (const std::string line = size_threads_to_free_cores(); !line.empty())
    std::fprintf(stderr, "anvil: %s\n", line.c_str());
  const ModelSource src = find_model_source(model_source_path(source_arg, overrides), model);
  const std::unique_ptr<Tokenizer> tok = model_source_tokenizer(src, tokenizer);
  const DType dt = dtype == "fp32" ? DType::f32 : DType::bf16;
  Llama llama(src.args, dt, src.args.max_seq_len);
  load_model_weights(src, llama.params());
  apply_model_state(src.model_state, llama);  // a MoE's expert biases choose its experts
  std::fprintf(stderr, "anvil: %s/%s from %s, %s, tokenizer %s\n", src.args.name.c_str(), src.args.flavor.c_str(),
               src.path.c_str(), dtype.c_str(), tok->name().c_str());

  std::vector<std::vector<int32_t>> ids;
  for (const std::string& p : prompts) {
    std::vector<int32_t> t;
    if (tok->bos_id() >= 0) t.push_back(tok->bos_id());  // documents begin with BOS in training
    const std::vector<int32_t> body = tok->encode(p);
    t.insert(t.end(), body.begin(), body.end());
    ids.push_back(t);
  }
  opts.eos_id = tok->eos_id();
  const bool stream = prompts.size() == 1;
  std::vector<int32_t> shown;  // the streamed sequence's tokens so far
  size_t printed = 0;
  if (stream) {
    std::printf("%s", prompts[0].c_str());
    std::fflush(stdout);
  }
  const Generation g = generate(llama, ids, opts, [&](size_t, int32_t t) {
    if (!stream || t == opts.eos_id) return;
    shown.push_back(t);
    const std::string text = tok->decode(shown);
    const size_t ready = complete_utf8_prefix(text);
    if (ready > printed) {
      std::fwrite(text.data() + printed, 1, ready - printed, stdout);
      std::fflush(stdout);
      printed = ready;
    }
  });
  if (stream) {
    const std::string text = tok->decode(shown);
    if (text.size() > printed) std::fwrite(text.data() + printed, 1, text.size() - printed, stdout);
    std::printf("\n");
  } else {
    for (size_t b = 0; b < prompts.size(); ++b) {
      std::vector<int32_t> t = g.tokens[b];
      if (!t.empty() && t.back() == opts.eos_id) t.pop_back();
      std::printf("[%zu] %s%s\n", b + 1, prompts[b].c_str(), tok->decode(t).c_str());
    }
  }
  std::fflush(stdout);
  const GenerateStats& s = g.stats;
  const int64_t decoded =
      s.generated_tokens - static_cast<int64_t>(prompts.size());  // the first came from the prompt's pass
  std::fprintf(stderr,
               "anvil: prompt %lld tokens in %.3f s (%.0f tokens/s); generated %lld tokens, %lld of them in %.3f s of "
               "decoding (%.1f tokens/s, batch %zu); key/value cache %.1f MiB%s\n",
               static_cast<long long>(s.prompt_tokens), s.prefill_seconds,
               s.prefill_seconds > 0 ? static_cast<double>(s.prompt_tokens) / s.prefill_seconds : 0.0,
               static_cast<long long>(s.generated_tokens), static_cast<long long>(decoded), s.decode_seconds,
               s.decode_seconds > 0 ? static_cast<double>(decoded) / s.decode_seconds : 0.0, prompts.size(),
               static_cast<double>(s.cache_bytes) / (1024.0 * 1024.0),
               s.context_full ? "; stopped at the model's context" : "");
  return 0;
}

}  // namespace anvil
