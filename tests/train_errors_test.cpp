// What `anvil train` says when its input is wrong: each message names the key
// that was wrong and the remedy in anvil train's own terms (not another
// command's flags), and what is disabled is not opened.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "test_util.h"

namespace fs = std::filesystem;

namespace {

using Output = anvil::testing::CommandOutput;
Output run(const std::string& args) { return anvil::testing::run_anvil(args); }

fs::path workdir(const std::string& name) {
  const fs::path dir = anvil::testing::scratch_root() / ("anvil_train_errors_" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream text(dir / "text.txt");
  for (int i = 0; i < 200; ++i) text << "Line " << i % 7 << ": a short sentence about the weather in the hills.\n";
  return dir;
}

std::string small_run(const fs::path& dir) {
  return "train --training.dataset text --training.seq_len 32 --training.local_batch_size 2 --training.steps 1"
         " --job.dump_folder " + (dir / "run").string();
}

bool has(const Output& out, const std::string& s) { return out.text.find(s) != std::string::npos; }

size_t count(const std::string& text, const std::string& s) {
  size_t n = 0;
  for (size_t at = text.find(s); at != std::string::npos; at = text.find(s, at + 1)) ++n;
  return n;
}

}  // namespace

TEST(TrainErrors, AMissingTokenizerNamesItsKeyTheScriptThatMakesItAndBytes) {
  const fs::path dir = workdir("tokenizer");
  const std::string data = " --training.dataset_path " + (dir / "text.txt").string();
  const std::string bpe = (dir / "tokenizers" / "shakespeare-2048" / "tokenizer.json").string();
  Output out = run(small_run(dir) + data + " --model.tokenizer_path " + bpe);
  EXPECT_EQ(out.exit_code, 1) << out.text;
  EXPECT_TRUE(has(out, "model.tokenizer_path = '" + bpe + "': no such file")) << out.text;
  EXPECT_TRUE(has(out, "anvil tokenizer train --input DIR --vocab-size N --output " + bpe)) << out.text;
  EXPECT_TRUE(has(out, "scripts/train.sh trains")) << out.text;
  EXPECT_TRUE(has(out, "set model.tokenizer_path = \"\"")) << out.text;
  EXPECT_FALSE(has(out, "prepare_llama3_tokenizer")) << "a trained BPE is not Llama 3's:\n" << out.text;
  // Llama 3's tokenizer is fetched, not trained.
  out = run(small_run(dir) + data + " --model.tokenizer_path " + (dir / "llama3" / "tokenizer.model").string());
  EXPECT_EQ(out.exit_code, 1) << out.text;
  EXPECT_TRUE(has(out, "scripts/prepare_llama3_tokenizer.sh fetches Llama 3's tokenizer")) << out.text;
}

// Block-causal attention finds documents by the tokenizer's EOS. A
// tokenizer.json with no EOS among its added tokens (here: none at all; its
// vocabulary GPT-2's byte alphabet, no merges) is refused before training,
// naming the key to change; the same tokenizer trains under causal attention.
TEST(TrainErrors, BlockCausalWithATokenizerWithoutEosNamesTheMaskToUse) {
  const fs::path dir = workdir("no_eos");
  const std::string data = " --training.dataset_path " + (dir / "text.txt").string();
  {
    // GPT-2's byte-to-unicode alphabet: printable Latin-1 bytes stand for
    // themselves, the other bytes for U+0100 onwards, in byte order.
    std::ofstream f(dir / "tokenizer.json");
    f << "{\"added_tokens\": [], \"model\": {\"type\": \"BPE\", \"merges\": [], \"vocab\": {";
    int next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      const int cp = printable ? b : next++;
      std::string utf8;
      if (cp < 0x80) {
        utf8 = std::string(1, static_cast<char>(cp));
      } else {
        utf8 += static_cast<char>(0xC0 | (cp >> 6));
        utf8 += static_cast<char>(0x80 | (cp & 0x3F));
      }
      if (utf8 == "\"" || utf8 == "\\") utf8 = "\\" + utf8;
      f << (b ? ", " : "") << "\"" << utf8 << "\": " << b;
    }
    f << "}}}\n";
  }
  const std::string tok = " --model.tokenizer_path " + (dir / "tokenizer.json").string();
  Output out = run(small_run(dir) + data + tok + " --model.attn_mask_type block_causal");
  EXPECT_EQ(out.exit_code, 1) << out.text;
  EXPECT_TRUE(has(out, "model.attn_mask_type = \"block_causal\" finds documents by their EOS token")) << out.text;
  EXPECT_TRUE(has(out, "tokenizer has none; set model.attn_mask_type = \"causal\"")) << out.text;
  out = run(small_run(dir) + data + tok + " --model.attn_mask_type causal");
  EXPECT_EQ(out.exit_code, 0) << out.text;
}

TEST(TrainErrors, AMissingDatasetNamesItsKeyAndAValidValueNotAnotherCommandsFlags) {
  const fs::path dir = workdir("dataset");
  const std::string missing = (dir / "nowhere.jsonl").string();
  Output out = run(small_run(dir) + " --training.dataset_path " + missing);
  EXPECT_EQ(out.exit_code, 1) << out.text;
  EXPECT_TRUE(has(out, "training.dataset_path = '" + missing + "': " + missing + ": no such file or directory"))
      << out.text;
  EXPECT_TRUE(has(out, "set training.dataset_path to a text or JSON Lines file")) << out.text;
  EXPECT_FALSE(has(out, "--skip-bad")) << out.text;
  EXPECT_FALSE(has(out, "--text-field")) << out.text;
  // The validation path, when validation is on, names its own key.
  out = run(small_run(dir) + " --training.dataset_path " + (dir / "text.txt").string() +
            " --validation.enable true --validation.dataset_path " + missing);
  EXPECT_EQ(out.exit_code, 1) << out.text;
  EXPECT_TRUE(has(out, "validation.dataset_path = '" + missing + "'")) << out.text;
  EXPECT_TRUE(has(out, "set validation.dataset_path to a text or JSON Lines file")) << out.text;
}

TEST(TrainErrors, DisabledValidationDoesNotOpenItsPath) {
  const fs::path dir = workdir("validation_off");
  const Output out = run(small_run(dir) + " --training.dataset_path " + (dir / "text.txt").string() +
                         " --validation.enable false --validation.dataset_path " + (dir / "gone.txt").string());
  EXPECT_EQ(out.exit_code, 0) << out.text;
  EXPECT_FALSE(has(out, "gone.txt")) << out.text;
}

TEST(TrainErrors, AFlavourInTheWrongCaseIsNamedAsMeant) {
  const fs::path dir = workdir("flavor");
  Output out = run(small_run(dir) + " --training.dataset_path " + (dir / "text.txt").string() + " --model.flavor 8b");
  EXPECT_EQ(out.exit_code, 1) << out.text;
  EXPECT_TRUE(has(out, "unknown model 'llama3' flavor '8b'; did you mean 'llama3' flavor '8B'?")) << out.text;
  EXPECT_TRUE(has(out, "set --model.name llama3 --model.flavor 8B")) << out.text;
  // A flavour that is no slip lists the known ones.
  out = run(small_run(dir) + " --training.dataset_path " + (dir / "text.txt").string() + " --model.flavor 9B");
  EXPECT_EQ(out.exit_code, 1) << out.text;
  EXPECT_TRUE(has(out, "unknown model 'llama3' flavor '9B'; known: ")) << out.text;
  EXPECT_FALSE(has(out, "did you mean")) << out.text;
}

TEST(TrainErrors, DataShorterThanOneSequenceTrainsWithOneWarningAndTheRepetitionFactor) {
  const fs::path dir = workdir("tiny");
  std::ofstream(dir / "tiny.txt") << "abc";  // 3 bytes: 3 tokens of the byte tokenizer
  const Output out = run(small_run(dir) + " --training.dataset_path " + (dir / "tiny.txt").string() +
                         " --training.steps 3");
  EXPECT_EQ(out.exit_code, 0) << out.text;
  EXPECT_EQ(count(out.text, "anvil: warning: the training data holds"), 1u) << out.text;
  EXPECT_TRUE(has(out, "fewer than one sequence (seq_len + 1 = 33): every sequence repeats it about")) << out.text;
}
