// Configuration: TOML, command-line overrides, and the errors a user sees.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "anvil/core/error.h"
#include "anvil/train/config.h"

using namespace anvil;

namespace {
// The message of the anvil::Error that `f` throws (fails the test if none).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected anvil::Error";
  return "";
}
bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }
}  // namespace

TEST(Config, TomlThenOverrides) {
  const std::string toml = R"(
[model]
flavor = "25M"

[training]
steps = 50
seq_len = 128
max_norm = 2   # an integer is fine where a number is expected
deterministic = false
)";
  JobConfig c = parse_config_text(toml, "job.toml",
                                  {"--training.steps", "7", "--optimizer.lr=3e-4", "--training.deterministic"});
  EXPECT_EQ(c.model.flavor, "25M");
  EXPECT_EQ(c.training.steps, 7);  // the flag wins over the file
  EXPECT_EQ(c.training.seq_len, 128);
  EXPECT_DOUBLE_EQ(c.training.max_norm, 2.0);
  EXPECT_DOUBLE_EQ(c.optimizer.lr, 3e-4);
  EXPECT_TRUE(c.training.deterministic);  // bare boolean
  EXPECT_EQ(c.model.name, "llama3");      // untouched default
  c = parse_config_text("", "none", {"--training.deterministic", "false", "--checkpoint.enable", "--metrics.log_freq", "3"});
  EXPECT_FALSE(c.training.deterministic);
  EXPECT_TRUE(c.checkpoint.enable);
  EXPECT_EQ(c.metrics.log_freq, 3);
}

TEST(Config, UnknownKeyNamesFileLineAndNearestKey) {
  const std::string msg = error_of([] { parse_config_text("[training]\nsteps = 3\nsetps = 4\n", "job.toml"); });
  EXPECT_TRUE(has(msg, "job.toml:3")) << msg;
  EXPECT_TRUE(has(msg, "training.setps")) << msg;
  EXPECT_TRUE(has(msg, "did you mean 'training.steps'")) << msg;
  // A key in the wrong section is suggested in its right one.
  const std::string msg2 = error_of([] { parse_config_text("", "x", {"--model.seq_len", "5"}); });
  EXPECT_TRUE(has(msg2, "command line --model.seq_len")) << msg2;
  EXPECT_TRUE(has(msg2, "training.seq_len")) << msg2;
}

TEST(Config, WrongTypesAndRangesAreRejected) {
  EXPECT_TRUE(has(error_of([] { parse_config_text("[training]\nsteps = \"ten\"\n", "a.toml"); }), "a.toml:2"));
  EXPECT_TRUE(has(error_of([] { parse_config_text("[training]\nsteps = 1.5\n", "a.toml"); }), "of type integer"));
  EXPECT_TRUE(has(error_of([] { parse_config_text("", "x", {"--training.steps", "0"}); }), "out of range"));
  EXPECT_TRUE(has(error_of([] { parse_config_text("", "x", {"--training.steps", "12abc"}); }), "integer"));
  EXPECT_TRUE(has(error_of([] { parse_config_text("", "x", {"--optimizer.beta2", "1.5"}); }), "out of range"));
  // A communication deadline cannot be switched off.
  const std::string deadline = error_of([] { parse_config_text("", "x", {"--comm.train_timeout_seconds", "0"}); });
  EXPECT_TRUE(has(deadline, "comm.train_timeout_seconds = 0 is out of range [1, inf]")) << deadline;
  EXPECT_TRUE(has(error_of([] { parse_config_text("", "x", {"--comm.init_timeout_seconds", "0"}); }), "out of range"));
  const std::string choice =
      error_of([] { parse_config_text("[activation_checkpoint]\nmode = \"partial\"\n", "a.toml"); });
  EXPECT_TRUE(has(choice, "a.toml:2")) << choice;
  EXPECT_TRUE(has(choice, "none, selective, full")) << choice;
  EXPECT_TRUE(has(error_of([] { parse_config_text("", "x", {"--training.deterministic", "maybe"}); }), "boolean"));
  EXPECT_TRUE(has(error_of([] { parse_config_text("", "x", {"--training.seq_len"}); }), "missing value"));
  EXPECT_TRUE(has(error_of([] { parse_config_text("", "x", {"steps"}); }), "unexpected argument"));
}

// The mixture-of-experts keys: a coefficient below -1 is out of range, one
// in (-1, 0) is neither the flavour's nor a coefficient, and on a dense model
// every one of them is refused by name rather than ignored.
TEST(Config, MixtureOfExpertsKeysAreCheckedAndRefusedOnADenseModel) {
  const auto model_args_error = [](std::vector<std::string> flags) {
    return error_of([&] { (void)job_model_args(parse_config_text("", "x", flags)); });
  };
  const std::vector<std::string> moe = {"--model.name", "qwen3", "--model.flavor", "debugmodel_moe"};
  std::vector<std::string> half = moe;
  half.insert(half.end(), {"--model.router_aux_loss_coef", "-0.5"});
  const std::string e = model_args_error(half);
  EXPECT_TRUE(has(e, "model.router_aux_loss_coef = -0.5 must be -1 (the flavour's) or a coefficient >= 0")) << e;
  EXPECT_TRUE(has(error_of([] { parse_config_text("", "x", {"--model.router_aux_loss_coef", "-2"}); }),
                  "out of range"));
  std::vector<std::string> fine = moe;
  fine.insert(fine.end(), {"--model.router_aux_loss_coef", "0", "--model.moe_routing", "balanced"});
  EXPECT_NO_THROW((void)job_model_args(parse_config_text("", "x", fine)));

  const std::string dense = model_args_error({"--model.moe_routing", "balanced", "--model.moe_estimate_load", "2"});
  EXPECT_TRUE(has(dense, "model.moe_routing, model.moe_estimate_load set for llama3/")) << dense;
  EXPECT_TRUE(has(dense, "has no mixture of experts")) << dense;
  for (const std::vector<std::string>& one :
       {std::vector<std::string>{"--model.moe_score_function", "sigmoid"},
        std::vector<std::string>{"--model.moe_bias_update_rate", "0.001"},
        std::vector<std::string>{"--model.router_aux_loss_coef", "0.01"}}) {
    const std::string m = model_args_error(one);
    EXPECT_TRUE(has(m, one[0].substr(2) + " set for ")) << m;
  }
  EXPECT_NO_THROW((void)job_model_args(parse_config_text("", "x", {})));
}

TEST(Config, SyntaxErrorAndMissingFileAreOneClearLine) {
  const std::string syntax = error_of([] { parse_config_text("[training\nsteps = 3\n", "bad.toml"); });
  EXPECT_TRUE(has(syntax, "bad.toml:1")) << syntax;
  EXPECT_TRUE(has(syntax, "TOML syntax error")) << syntax;
  const std::string missing = error_of([] { parse_config({"/nonexistent/job.toml"}); });
  EXPECT_TRUE(has(missing, "cannot read config file '/nonexistent/job.toml'")) << missing;
  EXPECT_EQ(missing.find('\n'), std::string::npos);
}

TEST(Config, HelpListsEveryKeyWithItsDefault) {
  const std::string help = config_help();
  EXPECT_TRUE(has(help, "--training.local_batch_size (integer, default 8)")) << help;
  EXPECT_TRUE(has(help, "--activation_checkpoint.mode (string, default \"none\")")) << help;
  EXPECT_TRUE(has(help, "--parallelism.tensor_parallel_degree")) << help;
  EXPECT_TRUE(has(help, "--comm.init_timeout_seconds (integer, default 300)")) << help;
  EXPECT_TRUE(has(help, "--comm.train_timeout_seconds (integer, default 100)")) << help;
}

TEST(Config, DocsMatchTheKeyTable) {
  // docs/configuration.md embeds `anvil config-docs`; regenerate it when keys change.
  std::ifstream in(std::string(ANVIL_SOURCE_DIR) + "/docs/configuration.md");
  ASSERT_TRUE(in.good());
  std::stringstream ss;
  ss << in.rdbuf();
  EXPECT_TRUE(has(ss.str(), config_markdown()))
      << "docs/configuration.md is stale: rebuild it with build/anvil config-docs (see the file's header)";
}
