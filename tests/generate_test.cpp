// anvil generate: decoding with the key/value cache against recomputing the
// whole sequence, greedy decoding against the PyTorch oracle
// (scripts/torch_llama.py --hf-generate), sampling's cuts and
// reproducibility, batches, and the command's errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "anvil/cli/generate_cmd.h"
#include "anvil/data/bpe_tokenizer.h"
#include "anvil/data/bpe_trainer.h"
#include "anvil/generate/generator.h"
#include "anvil/generate/sampler.h"
#include "anvil/model/hf_format.h"
#include "anvil/model/llama.h"
#include "anvil/train/checkpoint.h"
#include "anvil/train/model_source.h"
#include "oracles.h"
#include "test_util.h"

namespace fs = std::filesystem;

namespace anvil {
namespace {

using testing::error_of;
using testing::run_anvil;
using testing::scratch_root;

// Token ids spread over the vocabulary (a fixed pseudo-random sequence).
std::vector<int32_t> some_tokens(int64_t n, int64_t vocab, uint64_t seed) {
  std::vector<int32_t> out;
  for (int64_t i = 0; i < n; ++i)
    out.push_back(static_cast<int32_t>(uniform01(name_key("generate_test") + seed, static_cast<uint64_t>(i)) *
                                       static_cast<float>(vocab)));
  return out;
}

Tensor tokens_tensor(const std::vector<int32_t>& ids, int64_t first, int64_t n) {
  Tensor t = Tensor::empty({1, n}, DType::i32, MemCategory::activations, "tokens");
  std::copy(ids.begin() + first, ids.begin() + first + n, t.data<int32_t>());
  return t;
}

// max |a − b| / max |b| over row `row` of b (M, V) against a (1, V).
double row_error(const Tensor& a, const Tensor& b, int64_t row) {
  const int64_t V = b.size(1);
  double diff = 0, scale = 0;
  for (int64_t j = 0; j < V; ++j) {
    diff = std::max(diff, std::abs(static_cast<double>(a.item_f32(j)) - b.item_f32(row * V + j)));
    scale = std::max(scale, std::abs(static_cast<double>(b.item_f32(row * V + j))));
  }
  return diff / scale;
}

// For a flavour without GQA (debugmodel: 16 query and 16 KV heads) and one
// with it (25M: 8 and 4): the prompt's pass and every decoding step give the
// logits the training forward computes over the whole sequence, in fp32 to
// 1e-5 of the largest logit; two sequences in one batch, at different
// positions, give what each gives alone.
TEST(Generate, CachedDecodingGivesTheLogitsOfRecomputingTheWholeSequence) {
  for (const char* flavor : {"debugmodel", "25M"}) {
    const ModelArgs args = model_flavor("llama3", flavor);
    const int64_t P = 7, N = 9, L = P + N;
    Llama model(args, DType::f32, L);
    model.params().init(3);
    const std::vector<int32_t> ids = some_tokens(L, args.vocab_size, 1);
    StageSaved saved;
    model.forward(tokens_tensor(ids, 0, L), 1, L, AcPolicy{}, saved);
    const Tensor full = model.logits(saved);  // (L, V) f32
    KvCache cache(args, 2, L, DType::f32);
    double worst = row_error(model.forward_cached(tokens_tensor(ids, 0, P), {0}, {0}, cache), full, P - 1);
    for (int64_t i = P; i < L; ++i)
      worst = std::max(worst, row_error(model.forward_cached(tokens_tensor(ids, i, 1), {0}, {i}, cache), full, i));
    std::printf("%s (%lld query, %lld KV heads): cached decoding within %.2e of recomputing\n", flavor,
                static_cast<long long>(args.n_heads), static_cast<long long>(args.n_kv_heads), worst);
    EXPECT_LE(worst, 1e-5) << flavor;

    // Slot 1 holds a shorter prompt; one step decodes both sequences together.
    const std::vector<int32_t> other = some_tokens(4, args.vocab_size, 2);
    KvCache both(args, 2, L, DType::f32);
    model.forward_cached(tokens_tensor(ids, 0, P), {0}, {0}, both);
    model.forward_cached(tokens_tensor(other, 0, 3), {1}, {0}, both);
    Tensor step = Tensor::empty({2, 1}, DType::i32, MemCategory::activations, "tokens");
    step.data<int32_t>()[0] = ids[static_cast<size_t>(P)];
    step.data<int32_t>()[1] = other[3];
    const Tensor batched = model.forward_cached(step, {0, 1}, {P, 3}, both);
    KvCache alone(args, 1, L, DType::f32);
    model.forward_cached(tokens_tensor(other, 0, 3), {0}, {0}, alone);
    const Tensor single = model.forward_cached(tokens_tensor(other, 3, 1), {0}, {3}, alone);
    EXPECT_LE(row_error(batched.slice(0, 1), full, P), 1e-5) << flavor;
    EXPECT_LE(row_error(batched.slice(1, 1), single, 0), 1e-6) << flavor;
  }
}

GenerateOptions greedy(int64_t n) {
  GenerateOptions o;
  o.max_new_tokens = n;
  o.sampling.temperature = 0;
  return o;
}

// Greedy decoding of small models (GQA and not, Qwen3 with its q/k norms and
// head_dim apart from dim / heads, Qwen3-MoE with its experts routed token by
// token as the cache decodes), token for token against an oracle decoding the
// model's Hugging Face export (fp32): `PYTHON scripts/SCRIPT --hf-generate
// FOLDER --prompt-ids ... --max-new-tokens N --out FILE --logits-out FILE`.
// The argmax cannot see an error of scale, so the oracle's logits of the
// whole sequence (prompt and continuation, one forward) are held to Anvil's
// forward of it: within 1e-5 of the largest logit, element by element, in fp32
// (both sum in f32 over a few hundred terms per product: about 1e-6 apart).
void expect_greedy_matches_oracle(const std::string& python, const std::string& script, const std::string& oracle,
                                  const std::string& setup_hint) {
  const fs::path dir = scratch_root() / ("generate_" + script);
  fs::create_directories(dir);
  for (const auto& [family, flavor_name] : {std::pair{"llama3", "debugmodel"}, std::pair{"llama3", "25M"},
                                            std::pair{"qwen3", "debugmodel"}, std::pair{"qwen3", "debugmodel_moe"}}) {
    const ModelArgs args = model_flavor(family, flavor_name);
    const std::string flavor = std::string(family) + "_" + flavor_name;
    const int64_t n = 24;
    Llama model(args, DType::f32, 64);
    model.params().init(11);
    const std::vector<int32_t> prompt = some_tokens(6, args.vocab_size, 3);
    const Generation g = generate(model, {prompt}, greedy(n));
    ASSERT_EQ(static_cast<int64_t>(g.tokens[0].size()), n);

    const fs::path hf = dir / flavor;
    HfExportOptions opts;
    opts.dtype = DType::f32;
    export_hf(model.params(), args, hf.string(), opts);
    std::string ids;
    for (const int32_t t : prompt) {
      if (!ids.empty()) ids += ',';
      ids += std::to_string(t);
    }
    const fs::path out = dir / (flavor + "_oracle.json"), logits_file = dir / (flavor + "_oracle_logits.f32");
    fs::remove(logits_file);
    const std::string cmd = python + " " + ANVIL_SOURCE_DIR + "/scripts/" + script + " --hf-generate " + hf.string() +
                            " --prompt-ids " + ids + " --max-new-tokens " + std::to_string(n) + " --out " +
                            out.string() + " --logits-out " + logits_file.string() + " --threads 2 > /dev/null";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd << " failed; " << setup_hint;
    const nlohmann::json want_json = nlohmann::json::parse(std::ifstream(out));
    const std::vector<int32_t> want = want_json.at("tokens").get<std::vector<int32_t>>();
    const std::vector<double> margins = want_json.at("margins").get<std::vector<double>>();
    std::printf("%s: %lld greedy tokens; the smallest top-two margin %s saw: %.3g\n", flavor.c_str(),
                static_cast<long long>(n), oracle.c_str(), *std::min_element(margins.begin(), margins.end()));
    EXPECT_EQ(g.tokens[0], want) << flavor << " against " << oracle;

    // The logits of the whole sequence, Anvil's forward against the oracle's.
    std::vector<int32_t> whole = prompt;
    whole.insert(whole.end(), want.begin(), want.end());
    const int64_t L = static_cast<int64_t>(whole.size()), V = args.vocab_size;
    StageSaved saved;
    model.forward(tokens_tensor(whole, 0, L), 1, L, AcPolicy{}, saved);
    const Tensor mine = model.logits(saved);  // (L, V) f32
    std::vector<float> theirs(static_cast<size_t>(L * V));
    std::ifstream in(logits_file, std::ios::binary);
    in.read(reinterpret_cast<char*>(theirs.data()), static_cast<std::streamsize>(theirs.size() * sizeof(float)));
    ASSERT_TRUE(in && in.peek() == std::char_traits<char>::eof())
        << logits_file << " does not hold " << L << " x " << V << " float32 logits";
    double largest = 0, worst = 0;
    for (size_t i = 0; i < theirs.size(); ++i) {
      largest = std::max(largest, std::abs(static_cast<double>(theirs[i])));
      worst = std::max(worst, std::abs(static_cast<double>(mine.data<float>()[i]) - theirs[i]));
    }
    std::printf("%s: logits of %lld positions x %lld within %.2e of the largest logit (%.3g) against %s\n",
                flavor.c_str(), static_cast<long long>(L), static_cast<long long>(V), worst / largest, largest,
                oracle.c_str());
    EXPECT_GT(largest, 0.0) << flavor;
    EXPECT_LE(worst, 1e-5 * largest) << flavor << " against " << oracle;
  }
}

// PyTorch recomputing the whole sequence every step (scripts/torch_llama.py).
TEST(Generate, GreedyDecodingMatchesPyTorchTokenForToken) {
  expect_greedy_matches_oracle("/usr/bin/python3", "torch_llama.py", "PyTorch",
                               "scripts/setup.sh installs python3-torch");
}

// transformers' own classes (LlamaForCausalLM, Qwen3ForCausalLM,
// Qwen3MoeForCausalLM) with their KV cache, in the oracles' environment
// (tests/oracles.h: torch and transformers from PyPI, as Debian's python3-torch
// is too old for Qwen3): a failure under CI when it is missing.
TEST(Generate, GreedyDecodingMatchesTransformersTokenForToken) {
  ANVIL_NEED_ORACLES(python);
  expect_greedy_matches_oracle(python, "transformers_generate.py", "transformers",
                               "scripts/setup_oracles.sh makes the environment with torch and transformers");
}

// top_k 1 is greedy; a batch decodes each prompt as it would alone.
TEST(Generate, ASeedRepeatsItsTextAndTopKOneIsGreedy) {
  const ModelArgs args = model_flavor("llama3", "debugmodel");
  Llama model(args, DType::f32, 64);
  model.params().init(5);
  const std::vector<int32_t> p1 = some_tokens(5, args.vocab_size, 4), p2 = some_tokens(9, args.vocab_size, 5);
  GenerateOptions o;
  o.max_new_tokens = 20;
  o.sampling = {0.9f, 0, 0.95f, 42};
  const Generation a = generate(model, {p1}, o), b = generate(model, {p1}, o);
  EXPECT_EQ(a.tokens, b.tokens);
  o.sampling.seed = 43;
  EXPECT_NE(generate(model, {p1}, o).tokens, a.tokens);
  o.sampling = {0.9f, 1, 1.0f, 7};
  EXPECT_EQ(generate(model, {p1}, o).tokens, generate(model, {p1}, greedy(20)).tokens);
  // A batch of two, sampled: each sequence as it decodes alone (its draws are keyed by its place and step).
  o.sampling = {0.9f, 50, 0.9f, 3};
  const Generation batch = generate(model, {p1, p2}, o);
  EXPECT_EQ(batch.tokens[0], generate(model, {p1}, o).tokens[0]);
  const Generation greedy_batch = generate(model, {p1, p2}, greedy(12));
  EXPECT_EQ(greedy_batch.tokens[1], generate(model, {p2}, greedy(12)).tokens[0]);
}

// The sampler against its definition on four logits.
TEST(Generate, SamplerDrawsFromTheCutSoftmax) {
  const float logits[] = {2.0f, 1.0f, 0.0f, -1.0f};
  SamplingOptions o{1.0f, 0, 1.0f, 0};
  EXPECT_EQ(sample_token(logits, 4, {0.0f, 0, 1.0f, 0}, 0.99f), 0);  // greedy ignores the draw
  // Full softmax: the draw u picks by cumulative probability.
  double z = 0;
  for (const float l : logits) z += std::exp(l);
  const double p0 = std::exp(2.0) / z, p1 = std::exp(1.0) / z;
  EXPECT_EQ(sample_token(logits, 4, o, static_cast<float>(p0 - 1e-4)), 0);
  EXPECT_EQ(sample_token(logits, 4, o, static_cast<float>(p0 + 1e-4)), 1);
  EXPECT_EQ(sample_token(logits, 4, o, static_cast<float>(p0 + p1 + 1e-4)), 2);
  // top_k 2: only the two highest, renormalised.
  o.top_k = 2;
  EXPECT_EQ(sample_token(logits, 4, o, 0.999f), 1);
  EXPECT_EQ(sample_token(logits, 4, o, static_cast<float>(p0 / (p0 + p1) - 1e-4)), 0);
  // top_p below the top token's probability keeps it alone.
  o = {1.0f, 0, static_cast<float>(p0 - 0.01), 0};
  EXPECT_EQ(sample_token(logits, 4, o, 0.999f), 0);
  EXPECT_NE(error_of([&] {
              sample_token(logits, 4, {-1.0f, 0, 1.0f, 0}, 0.5f);
            }).find("temperature"),
            std::string::npos);
  EXPECT_NE(error_of([&] { sample_token(logits, 4, {1.0f, 0, 0.0f, 0}, 0.5f); }).find("top_p"), std::string::npos);
}

TEST(Generate, APromptAsLongAsTheContextIsRefused) {
  const ModelArgs args = model_flavor("llama3", "debugmodel");
  Llama model(args, DType::f32, 16);
  model.params().init(1);
  const std::string e = error_of([&] { generate(model, {some_tokens(16, args.vocab_size, 6)}, greedy(4)); });
  EXPECT_NE(e.find("prompt 1 is 16 tokens, but the model's context is 16"), std::string::npos) << e;
  // One token short of the context: the prompt's pass gives a token, which
  // takes the last position and gives one more; then the context is full.
  const Generation g = generate(model, {some_tokens(15, args.vocab_size, 6)}, greedy(4));
  EXPECT_EQ(g.tokens[0].size(), 2u);
  EXPECT_TRUE(g.stats.context_full);
}

TEST(Generate, StreamedTextWaitsForWholeUtf8Characters) {
  EXPECT_EQ(complete_utf8_prefix("abc"), 3u);
  EXPECT_EQ(complete_utf8_prefix("a\xC3"), 1u);             // é's first byte
  EXPECT_EQ(complete_utf8_prefix("a\xC3\xA9"), 3u);         // é
  EXPECT_EQ(complete_utf8_prefix("a\xE2\x82"), 1u);         // € cut after two of three bytes
  EXPECT_EQ(complete_utf8_prefix("\xF0\x9F\x98\x80"), 4u);  // an emoji
  EXPECT_EQ(complete_utf8_prefix(""), 0u);
}

// The command: a model-only checkpoint (step 3) of a flavour's model from
// seed 2, with `extra` fields in its state.json; the byte tokenizer. The
// experts' down projections are scaled by `expert_gain`: at initialisation
// a MoE layer's output is small beside the residual stream, so which experts
// a token meets seldom moves its argmax; a gain makes it count.
fs::path debug_checkpoint(const fs::path& dir, const std::string& name = "llama3",
                          const std::string& flavor = "debugmodel", const nlohmann::json& extra = {},
                          float expert_gain = 1.0f) {
  Llama model(model_flavor(name, flavor), DType::f32, 64);
  model.params().init(2);
  std::vector<std::pair<std::string, Tensor>> weights;
  for (size_t i = 0; i < model.params().specs().size(); ++i) {
    const std::string& tensor = model.params().specs()[i].name;
    Tensor w = model.params().master(static_cast<int>(i));
    if (expert_gain != 1.0f && tensor.find(".mlp.experts.") != std::string::npos &&
        tensor.find("down_proj") != std::string::npos)
      for (int64_t j = 0; j < w.numel(); ++j) w.data<float>()[j] *= expert_gain;
    weights.emplace_back(tensor, w);
  }
  save_model_only_checkpoint(dir.string(), 3, weights, name + "/" + flavor, extra);
  return dir / "step-3";
}

// A tokenizer.json of `vocab` ids: the 256 bytes, then every other id
// decoding to "<id>", and no BOS or EOS. The byte tokenizer prints nothing for
// ids past its 258, so under it a command's text hides most of what a model of
// 2048 tokens chose; under this one the text names every token.
fs::path id_tokenizer(const fs::path& path, int64_t vocab) {
  nlohmann::json ids = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) ids[bytes_to_unicode(std::string(1, static_cast<char>(b)))] = b;
  for (int64_t id = 256; id < vocab; ++id) {
    std::string name = "<";  // built in steps: GCC 12 warns falsely (-Wrestrict) on "<" + s + ">"
    name += std::to_string(id);
    name += '>';
    ids[name] = id;
  }
  nlohmann::json doc;
  doc["model"] = {{"type", "BPE"}, {"vocab", ids}, {"merges", nlohmann::json::array()}};
  std::ofstream(path) << doc.dump();
  return path;
}

// The greedy continuation `anvil generate STEP --tokenizer TOKENIZER
// --temperature 0 --dtype fp32 --prompt PROMPT` must print, decoded here as
// the command decodes it: the source's weights and model state, the prompt
// after the tokenizer's BOS when it has one, a stop at its EOS.
std::vector<int32_t> greedy_continuation(const fs::path& step, const fs::path& tokenizer, const std::string& prompt,
                                         int64_t n) {
  const ModelSource src = find_model_source(step.string());
  const std::unique_ptr<Tokenizer> tok = model_source_tokenizer(src, tokenizer.string());
  Llama model(src.args, DType::f32, src.args.max_seq_len);
  load_model_weights(src, model.params());
  apply_model_state(src.model_state, model);
  std::vector<int32_t> ids;
  if (tok->bos_id() >= 0) ids.push_back(tok->bos_id());
  const std::vector<int32_t> body = tok->encode(prompt);
  ids.insert(ids.end(), body.begin(), body.end());
  GenerateOptions o = greedy(n);
  o.eos_id = tok->eos_id();
  return generate(model, {ids}, o).tokens[0];
}

// A checkpoint of a MoE trained with DeepSeek-V3's router options: the model
// it stands for routes as its job did (the options from its config.toml, the
// experts' biases from state.json's model_state), and the command prints the
// tokens that model decodes greedily, token for token. The same weights with
// the biases zeroed decode other tokens, and the command prints those: so the
// command's tokens show the biases loaded and used.
TEST(GenerateCommand, AMoeCheckpointRoutesWithItsJobsOptionsAndBiases) {
  const fs::path dir = scratch_root() / "generate_moe_bias";
  fs::remove_all(dir);
  const ModelArgs flavour = model_flavor("qwen3", "debugmodel_moe");
  const size_t E = static_cast<size_t>(flavour.num_experts);
  std::vector<float> bias(static_cast<size_t>(flavour.n_layers) * E);
  for (size_t i = 0; i < bias.size(); ++i) bias[i] = 0.001f * static_cast<float>(i % 7) - 0.003f;
  // Sigmoid scores lie in (0, 1): a bias of 2 makes two experts of each layer
  // (another pair in each) take every token, which the scores alone would
  // seldom choose, so every token's experts change with the biases, not only
  // those whose scores nearly tie.
  for (size_t l = 0; l < static_cast<size_t>(flavour.n_layers); ++l) {
    bias[l * E + l % E] += 2.0f;
    bias[l * E + (3 * l + 1) % E] += 2.0f;
  }
  const float gain = 30.0f;
  const fs::path step =
      debug_checkpoint(dir / "checkpoint", "qwen3", "debugmodel_moe", {{"model_state", {{"expert_bias", bias}}}}, gain);
  const std::vector<float> zeros(bias.size(), 0.0f);
  const fs::path unbiased = debug_checkpoint(dir / "checkpoint_unbiased", "qwen3", "debugmodel_moe",
                                             {{"model_state", {{"expert_bias", zeros}}}}, gain);
  for (const fs::path& s : {step, unbiased})
    std::ofstream(s / "config.toml") << "[model]\nname = \"qwen3\"\nflavor = \"debugmodel_moe\"\n"
                                        "moe_score_function = \"sigmoid\"\nmoe_bias_update_rate = 0.001\n";
  const ModelSource src = find_model_source(step.string());
  EXPECT_TRUE(src.args.moe_sigmoid_scores);
  EXPECT_EQ(src.args.moe_bias_update_rate, 0.001);
  Llama model(src.args, DType::f32, 64);
  apply_model_state(src.model_state, model);
  EXPECT_EQ(model.moe_state()->expert_bias, bias);

  const fs::path tokenizer = id_tokenizer(dir / "ids.json", flavour.vocab_size);
  const std::unique_ptr<Tokenizer> tok = load_tokenizer(tokenizer.string());
  const std::string prompt = "Once";
  const int64_t n = 16;
  const std::vector<int32_t> want = greedy_continuation(step, tokenizer, prompt, n);
  const std::vector<int32_t> without = greedy_continuation(unbiased, tokenizer, prompt, n);
  ASSERT_EQ(static_cast<int64_t>(want.size()), n);  // no EOS to stop at, and far from the context
  ASSERT_NE(want, without) << "the biases change no token, so the command's tokens cannot show them used";
  ASSERT_NE(tok->decode(want), tok->decode(without));
  // The streamed continuation, the prompt then its tokens' text, is the whole
  // line between the banner and the speed line.
  for (const auto& [source, tokens] : {std::pair{step, want}, std::pair{unbiased, without}}) {
    const testing::CommandOutput out =
        run_anvil("generate " + source.string() + " --tokenizer " + tokenizer.string() + " --max_new_tokens " +
                  std::to_string(n) + " --temperature 0 --dtype fp32 --prompt '" + prompt + "'");
    EXPECT_EQ(out.exit_code, 0) << out.text;
    EXPECT_NE(out.text.find("\n" + prompt + tok->decode(tokens) + "\nanvil: prompt"), std::string::npos)
        << source << ": want the tokens " << ::testing::PrintToString(tokens) << " printed, got\n"
        << out.text;
  }
}

TEST(GenerateCommand, ContinuesAPromptAndExplainsBadInput) {
  const fs::path dir = scratch_root() / "generate_cmd";
  fs::remove_all(dir);
  const fs::path step = debug_checkpoint(dir / "checkpoint");
  // The checkpoint folder stands for its newest step; the same seed twice gives the same text.
  const std::string common = " --tokenizer bytes --max_new_tokens 12 --seed 9 --dtype fp32 --prompt 'Once upon'";
  const testing::CommandOutput a = run_anvil("generate " + (dir / "checkpoint").string() + common);
  const testing::CommandOutput b = run_anvil("generate " + step.string() + common);
  ASSERT_EQ(a.exit_code, 0) << a.text;
  EXPECT_EQ(a.text.rfind("anvil: llama3/debugmodel from " + step.string(), 0), 0u) << a.text;
  EXPECT_NE(a.text.find("\nOnce upon"), std::string::npos) << a.text;
  EXPECT_NE(a.text.find("tokens/s"), std::string::npos) << a.text;
  // The text: what lies between the banner's line and the speed line.
  auto text_of = [](const std::string& out) {
    const size_t from = out.find('\n') + 1;
    return out.substr(from, out.find("anvil: prompt") - from);
  };
  EXPECT_EQ(text_of(a.text), text_of(b.text));
  EXPECT_EQ(text_of(a.text).rfind("Once upon", 0), 0u) << a.text;
  // A batch prints each continuation after its prompt.
  const testing::CommandOutput batch =
      run_anvil("generate " + step.string() + common + " --prompt 'The' --temperature 0");
  ASSERT_EQ(batch.exit_code, 0) << batch.text;
  EXPECT_NE(batch.text.find("[1] Once upon"), std::string::npos) << batch.text;
  EXPECT_NE(batch.text.find("[2] The"), std::string::npos) << batch.text;

  // Bad input: one clear line each.
  auto fails_with = [&](const std::string& args, const std::string& want) {
    const testing::CommandOutput out = run_anvil("generate " + args);
    EXPECT_NE(out.exit_code, 0) << args;
    EXPECT_NE(out.text.find(want), std::string::npos) << args << "\n" << out.text;
  };
  fails_with((dir / "nowhere").string() + " --prompt x --tokenizer bytes", "does not exist");
  fails_with(step.string() + " --tokenizer bytes", "needs at least one --prompt");
  fails_with(step.string() + " --prompt x", "holds no config.toml naming its tokenizer");
  // A bad sampling option is refused before the model loads: the error is the
  // first and only thing printed (no banner, no prompt echoed).
  {
    const testing::CommandOutput out =
        run_anvil("generate " + step.string() + " --prompt Xyzzy --tokenizer bytes --top_p 0");
    EXPECT_NE(out.exit_code, 0);
    EXPECT_EQ(out.text.rfind("anvil: error: --top_p 0 is outside (0, 1]", 0), 0u) << out.text;
    EXPECT_EQ(out.text.find("Xyzzy"), std::string::npos) << out.text;
    EXPECT_EQ(out.text.find("llama3/debugmodel from"), std::string::npos) << out.text;
  }
  // A tokenizer larger than the model's vocabulary is not its tokenizer: a
  // 3000-token BPE learned from made-up words.
  {
    std::ofstream text(dir / "words.txt");
    uint64_t x = 12345;
    for (int w = 0; w < 40000; ++w) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      const int len = 3 + static_cast<int>((x >> 60) % 6);
      for (int c = 0; c < len; ++c) text << static_cast<char>('a' + ((x >> (8 + 5 * c)) % 26));
      text << (w % 12 == 11 ? ".\n" : " ");
    }
  }
  const testing::CommandOutput trained =
      run_anvil("tokenizer train --vocab-size 3000 --input " + (dir / "words.txt").string() + " --output " +
                (dir / "big.json").string());
  ASSERT_EQ(trained.exit_code, 0) << trained.text;
  fails_with(step.string() + " --prompt x --tokenizer " + (dir / "big.json").string(),
             "has 3000 tokens but llama3/debugmodel's vocabulary is 2048");
  // A corrupt checkpoint: its weights no longer match the checksum state.json recorded.
  {
    std::fstream f(step / "model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-16, std::ios::end);
    f.write("corrupted bytes!", 16);
  }
  fails_with(step.string() + " --prompt x --tokenizer bytes", "model.safetensors");
}

}  // namespace
}  // namespace anvil
