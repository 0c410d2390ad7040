// The command line as its users expect a tool to behave: --version, the usage
// on no arguments, a "did you mean" for a mistyped command, every
// subcommand's --help with an example; convert's checkpoint forms and
// flavour inference (the same as generate's); estimate's verdict on this
// machine and on GPUs, with thousands separators; plan's GPU-only note.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>

#include "anvil/core/safetensors.h"
#include "anvil/model/llama.h"
#include "anvil/train/checkpoint.h"
#include "anvil/train/console.h"
#include "test_util.h"

namespace fs = std::filesystem;

namespace anvil {
namespace {

using testing::CommandOutput;
using testing::run_anvil;

bool has(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// What the program writes to stdout alone (stderr discarded).
std::string stdout_of(const std::string& args) {
  const std::string cmd = std::string(ANVIL_BINARY) + " " + args + " 2>/dev/null";
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  pclose(p);
  return out;
}

std::string last_line(std::string text) {
  while (!text.empty() && text.back() == '\n') text.pop_back();
  return text.substr(text.rfind('\n') + 1);  // npos + 1 is 0: the whole text
}

std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(Cli, VersionPrintsTheVersionAndTheGitCommit) {
  const CommandOutput v = run_anvil("--version");
  EXPECT_EQ(v.exit_code, 0) << v.text;
  const std::regex line(R"(anvil [0-9]+\.[0-9]+\.[0-9]+ \(commit ([0-9a-f]{7,40}(-dirty)?|unknown)\)\n)");
  EXPECT_TRUE(std::regex_match(v.text, line)) << v.text;
  // `anvil info` says the same on its first line.
  const CommandOutput info = run_anvil("info");
  ASSERT_EQ(info.exit_code, 0) << info.text;
  EXPECT_EQ(info.text.substr(0, info.text.find('\n') + 1), v.text) << info.text;
}

TEST(Cli, NoArgumentsPrintsTheUsageOnStderrAndExits2) {
  const CommandOutput none = run_anvil("");
  EXPECT_EQ(none.exit_code, 2) << none.text;
  EXPECT_EQ(none.text.rfind("usage: anvil <command> [options]\n", 0), 0u) << none.text;
  EXPECT_EQ(stdout_of(""), "") << "the usage of a bare `anvil` belongs on stderr";
  // Asked for, the same usage on stdout and exit 0.
  for (const std::string ask : {"help", "--help", "-h"}) {
    const CommandOutput help = run_anvil(ask);
    EXPECT_EQ(help.exit_code, 0) << ask;
    EXPECT_EQ(help.text, none.text) << ask;
    EXPECT_EQ(stdout_of(ask), none.text) << ask;
  }
}

TEST(Cli, AMistypedCommandGetsADidYouMean) {
  const CommandOutput trian = run_anvil("trian");
  EXPECT_EQ(trian.exit_code, 2) << trian.text;
  EXPECT_TRUE(has(trian.text, "anvil: unknown command 'trian'; did you mean 'train'?")) << trian.text;
  const CommandOutput estimat = run_anvil("estimat configs/debugmodel.toml");
  EXPECT_EQ(estimat.exit_code, 2) << estimat.text;
  EXPECT_TRUE(has(estimat.text, "unknown command 'estimat'; did you mean 'estimate'?")) << estimat.text;
  // Nothing near: no guess, the pointer to the list.
  const CommandOutput far = run_anvil("xyzzy");
  EXPECT_EQ(far.exit_code, 2) << far.text;
  EXPECT_EQ(far.text, "anvil: unknown command 'xyzzy'; run 'anvil help' for the list\n");
  // The sub-commands of tokenizer and convert too.
  const CommandOutput encdoe = run_anvil("tokenizer encdoe --tokenizer bytes");
  EXPECT_EQ(encdoe.exit_code, 2) << encdoe.text;
  EXPECT_TRUE(has(encdoe.text, "unknown sub-command \"encdoe\"; did you mean \"encode\"?")) << encdoe.text;
  const CommandOutput exprot = run_anvil("convert exprot a b");
  EXPECT_EQ(exprot.exit_code, 1) << exprot.text;
  EXPECT_TRUE(has(exprot.text, "anvil convert needs 'export' or 'import'; did you mean 'export'?")) << exprot.text;
}

// Every command of `anvil help`, and each sub-command, answers --help and -h
// with its own usage (naming it) and at least one example of it, exit 0,
// without running.
TEST(Cli, EveryCommandAnswersHelpWithItsUsageAndAnExample) {
  const std::vector<std::string> commands = {"train",
                                             "estimate",
                                             "tokenizer",
                                             "tokenizer encode",
                                             "tokenizer decode",
                                             "tokenizer train",
                                             "tokenize",
                                             "report",
                                             "plan",
                                             "calibrate",
                                             "pipeline-schedule",
                                             "generate",
                                             "convert",
                                             "convert export",
                                             "convert import",
                                             "config-docs",
                                             "info"};
  const std::string overview = run_anvil("help").text;
  for (const std::string& cmd : commands) {
    // The list covers what `anvil help` offers.
    EXPECT_TRUE(has(overview, "\n  " + cmd)) << cmd << " is not in `anvil help`:\n" << overview;
    for (const std::string flag : {"--help", "-h"}) {
      SCOPED_TRACE(cmd + " " + flag);
      const CommandOutput out = run_anvil(cmd + " " + flag);
      EXPECT_EQ(out.exit_code, 0) << out.text;
      EXPECT_EQ(out.text.rfind("usage: ", 0), 0u) << out.text;
      const size_t example = out.text.find("\nexample");
      ASSERT_NE(example, std::string::npos) << out.text;
      EXPECT_TRUE(has(out.text.substr(0, example), "anvil " + cmd)) << out.text;
      // An example line runs this very command.
      const std::string examples = out.text.substr(example);
      EXPECT_TRUE(std::regex_search(examples, std::regex("\n  [^\n]*anvil " + cmd + "[ \n]"))) << out.text;
    }
  }
  // The three that ran instead of helping, and estimate, which printed train's usage.
  EXPECT_FALSE(has(run_anvil("info --help").text, "threads:"));
  EXPECT_FALSE(has(run_anvil("config-docs --help").text, "| key | type |"));
  EXPECT_FALSE(has(run_anvil("estimate --help").text, "anvil train ["));
  EXPECT_TRUE(has(run_anvil("estimate --help").text, "--training.local_batch_size (integer, default 8)"));
}

// A model-only checkpoint of llama3/debugmodel's model initialised from `seed`.
void save_checkpoint(const fs::path& folder, int64_t step, uint64_t seed, const std::string& name = "llama3",
                     const std::string& flavor = "debugmodel") {
  Llama model(model_flavor(name, flavor), DType::f32, 64);
  model.params().init(seed);
  std::vector<std::pair<std::string, Tensor>> weights;
  for (size_t i = 0; i < model.params().specs().size(); ++i)
    weights.emplace_back(model.params().specs()[i].name, model.params().master(static_cast<int>(i)));
  save_model_only_checkpoint(folder.string(), step, weights, name + "/" + flavor);
}

void expect_same_tensors(const fs::path& a, const fs::path& b) {
  const auto ta = load_safetensors(a.string()).tensors, tb = load_safetensors(b.string()).tensors;
  ASSERT_EQ(ta.size(), tb.size());
  for (const auto& [name, t] : ta) {
    ASSERT_TRUE(tb.count(name)) << name;
    const Tensor& u = tb.at(name);
    ASSERT_EQ(t.nbytes(), u.nbytes()) << name;
    EXPECT_EQ(std::memcmp(t.raw(), u.raw(), t.nbytes()), 0) << name;
  }
}

// convert export reads every checkpoint form generate reads: the step folder,
// the checkpoint folder (its newest step), the job's dump folder and its
// CONFIG.toml (with overrides); each gives the same Hugging Face folder.
TEST(Cli, ConvertExportTakesEveryCheckpointFormGenerateTakes) {
  const fs::path dir = testing::scratch_root() / "cli_convert_forms";
  fs::remove_all(dir);
  const fs::path run = dir / "run", ckpt = run / "checkpoint", step3 = ckpt / "step-3";
  save_checkpoint(ckpt, 1, 1);
  save_checkpoint(ckpt, 3, 2);  // the newest
  std::ofstream(dir / "job.toml") << "[job]\ndump_folder = \"" << run.string() << "\"\n";
  std::ofstream(dir / "elsewhere.toml") << "[job]\ndump_folder = \"" << (dir / "nothing").string() << "\"\n";

  const std::vector<std::pair<std::string, std::string>> forms = {
      {"step folder", step3.string()},
      {"checkpoint folder", ckpt.string()},
      {"dump folder", run.string()},
      {"config", (dir / "job.toml").string()},
      {"config with an override", (dir / "elsewhere.toml").string() + " --job.dump_folder " + run.string()},
  };
  for (size_t i = 0; i < forms.size(); ++i) {
    SCOPED_TRACE(forms[i].first);
    const fs::path out = dir / ("hf" + std::to_string(i));
    const CommandOutput r = run_anvil("convert export " + forms[i].second + " " + out.string());
    ASSERT_EQ(r.exit_code, 0) << r.text;
    EXPECT_TRUE(has(r.text, "anvil: exporting " + step3.string() + " (llama3/debugmodel, step 3")) << r.text;
    if (i > 0) {
      EXPECT_EQ(read_bytes(out / "model.safetensors"), read_bytes(dir / "hf0" / "model.safetensors"));
    }
  }
  // A job that has saved nothing yet, and a Hugging Face folder, say so.
  const CommandOutput none =
      run_anvil("convert export " + (dir / "elsewhere.toml").string() + " " + (dir / "hf_none").string());
  EXPECT_EQ(none.exit_code, 1);
  EXPECT_TRUE(has(none.text, "has saved no checkpoint yet")) << none.text;
  const CommandOutput hf = run_anvil("convert export " + (dir / "hf0").string() + " " + (dir / "hf_again").string());
  EXPECT_EQ(hf.exit_code, 1);
  EXPECT_TRUE(has(hf.text, "is a Hugging Face folder already; convert export reads an Anvil checkpoint")) << hf.text;

  // Import finds the flavour from config.json, as generate does: no --model.flavor.
  const CommandOutput imported = run_anvil("convert import " + (dir / "hf0").string() + " " + (dir / "back").string());
  ASSERT_EQ(imported.exit_code, 0) << imported.text;
  EXPECT_TRUE(has(imported.text, "anvil: importing " + (dir / "hf0").string() + " as llama3/debugmodel"))
      << imported.text;
  expect_same_tensors(dir / "back" / "step-0" / "model.safetensors", step3 / "model.safetensors");
  // An Anvil checkpoint is not a Hugging Face folder.
  const CommandOutput wrong = run_anvil("convert import " + step3.string() + " " + (dir / "back2").string());
  EXPECT_EQ(wrong.exit_code, 1);
  EXPECT_TRUE(has(wrong.text, "is an Anvil checkpoint, not a Hugging Face folder")) << wrong.text;
}

// The architectures convert's help names, each both ways with the flavour inferred.
TEST(Cli, ConvertInfersQwen3AndQwen3MoeFlavours) {
  const fs::path dir = testing::scratch_root() / "cli_convert_qwen3";
  fs::remove_all(dir);
  const std::string help = run_anvil("convert --help").text;
  for (const std::string arch : {"LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"})
    EXPECT_TRUE(has(help, arch)) << help;
  for (const std::string flavor : {"debugmodel", "debugmodel_moe"}) {
    SCOPED_TRACE(flavor);
    const fs::path ckpt = dir / flavor;
    save_checkpoint(ckpt, 5, 3, "qwen3", flavor);
    const CommandOutput out = run_anvil("convert export " + ckpt.string() + " " + (dir / (flavor + "_hf")).string());
    ASSERT_EQ(out.exit_code, 0) << out.text;
    const CommandOutput in =
        run_anvil("convert import " + (dir / (flavor + "_hf")).string() + " " + (dir / (flavor + "_back")).string());
    ASSERT_EQ(in.exit_code, 0) << in.text;
    EXPECT_TRUE(has(in.text, " as qwen3/" + flavor + " (")) << in.text;
    expect_same_tensors(dir / (flavor + "_back") / "step-0" / "model.safetensors",
                        ckpt / "step-5" / "model.safetensors");
  }
}

// estimate ends with the verdict anvil train's pre-flight check would give:
// debugmodel fits; llama3/8B with a large batch in one process fits no
// machine, and the refusal names what would fit, as train's does. Large
// counts have thousands separators.
TEST(Cli, EstimateEndsWithTheVerdictOnThisMachine) {
  const std::string debug = ANVIL_SOURCE_DIR "/configs/debugmodel.toml";
  const CommandOutput fits = run_anvil("estimate " + debug);
  ASSERT_EQ(fits.exit_code, 0) << fits.text;
  EXPECT_EQ(last_line(fits.text).rfind("verdict: fits this machine: the fullest rank (rank 0) needs ", 0), 0u)
      << fits.text;
  const CommandOutput fits_json = run_anvil("estimate " + debug + " --json");
  ASSERT_EQ(fits_json.exit_code, 0) << fits_json.text;
  const nlohmann::json j = nlohmann::json::parse(fits_json.text);
  EXPECT_EQ(j.at("fits_this_machine"), true);
  EXPECT_GT(j.at("available_bytes").get<double>(), 0);
  EXPECT_EQ(j.at("ranks_on_this_machine"), 1);
  // The same verdict, up to the memory available, which moves between the two runs.
  const auto need = [](const std::string& verdict) { return verdict.substr(0, verdict.find(" of the ")); };
  EXPECT_EQ(need(j.at("verdict").get<std::string>()), need(last_line(fits.text)));
  // Thousands separators: the model's parameters and FLOPs per token.
  const ModelArgs args = model_flavor("llama3", "debugmodel");
  EXPECT_TRUE(has(fits.text, "llama3/debugmodel: " + with_commas(args.num_params()) + " parameters, " +
                                 with_commas(std::llround(j.at("flops_per_token").get<double>())) +
                                 " FLOPs per token at seq_len 256"))
      << fits.text;
  EXPECT_TRUE(std::regex_search(fits.text, std::regex(" [0-9]{1,3}(,[0-9]{3})+ parameters"))) << fits.text;

  // llama3/8B, 16 x 8192 tokens in one process: over 500 GiB.
  const CommandOutput huge =
      run_anvil("estimate " ANVIL_SOURCE_DIR "/configs/llama3_8b.toml --training.local_batch_size 16");
  ASSERT_EQ(huge.exit_code, 0) << huge.text;
  const std::string verdict = last_line(huge.text);
  EXPECT_EQ(verdict.rfind("verdict: does not fit this machine: llama3/8B has " +
                              with_commas(model_flavor("llama3", "8B").num_params()) +
                              " parameters; predicted peak memory of rank 0 is ",
                          0),
            0u)
      << huge.text;
  // The refusal's own suggestions (train/preflight.cpp), or its word that none exists.
  EXPECT_TRUE(has(verdict, "What would fit, by the same estimate:") || has(verdict, "No single change fits"))
      << verdict;
}

// On GPUs: the named GPU's memory. llama3/8B at 8192 tokens does not fit one
// H100 (its fp32 weights and AdamW state alone are 120 GiB) and fits eight
// under FSDP; the per-GPU parameter counts are per GPU.
TEST(Cli, EstimateOnGpusSaysWhetherItFitsTheirMemory) {
  const std::string cfg = ANVIL_SOURCE_DIR "/configs/llama3_8b.toml";
  const CommandOutput one = run_anvil("estimate " + cfg + " --hardware h100-80g --gpus 1");
  ASSERT_EQ(one.exit_code, 0) << one.text;
  EXPECT_EQ(last_line(one.text).rfind("verdict: does not fit 1 x h100-80g: max reserved ", 0), 0u) << one.text;
  EXPECT_TRUE(has(last_line(one.text), "No layout of 1 x h100-80g fits: more GPUs")) << one.text;

  const CommandOutput eight = run_anvil("estimate " + cfg + " --hardware h100-80g --gpus 8");
  ASSERT_EQ(eight.exit_code, 0) << eight.text;
  EXPECT_EQ(last_line(eight.text).rfind("verdict: fits 8 x h100-80g: max reserved ", 0), 0u) << eight.text;
  const int64_t params = model_flavor("llama3", "8B").num_params();
  EXPECT_TRUE(has(eight.text, "parameters: " + with_commas(params) + " in the model; per GPU, " +
                                  with_commas(std::llround(static_cast<double>(params) / 8)) +
                                  " stored (its FSDP shard) and " + with_commas(params) + " gathered to compute"))
      << eight.text;

  // Without activation checkpointing 8 x 8192 tokens do not fit: the verdict offers layouts that do.
  const CommandOutput heavy = run_anvil("estimate " + cfg +
                                        " --activation_checkpoint.mode none --training.local_batch_size 8"
                                        " --hardware h100-80g --gpus 8 --json");
  ASSERT_EQ(heavy.exit_code, 0) << heavy.text;
  const nlohmann::json h = nlohmann::json::parse(heavy.text);
  EXPECT_EQ(h.at("fits"), false);
  ASSERT_FALSE(h.at("fitting_layouts").empty()) << heavy.text;
  for (const nlohmann::json& row : h.at("fitting_layouts"))
    EXPECT_LE(row.at("max_reserved_bytes").get<double>(), h.at("hbm_bytes").get<double>());
  EXPECT_TRUE(has(h.at("verdict").get<std::string>(), "What fits on 8 x h100-80g, fastest first (anvil plan): 1) "))
      << h.at("verdict");
}

TEST(Cli, PlanSaysItsLayoutsAreForGpuClustersAnvilDoesNotTrainOnYet) {
  const CommandOutput out =
      run_anvil("plan " ANVIL_SOURCE_DIR "/configs/llama3_8b.toml --hardware h100-80g --gpus 8 --top 2");
  ASSERT_EQ(out.exit_code, 0) << out.text;
  EXPECT_EQ(out.text.substr(0, out.text.find('\n')),
            "note: these layouts are for GPU clusters, which Anvil plans but does not train on yet (it trains on "
            "CPUs)");
}

}  // namespace
}  // namespace anvil
