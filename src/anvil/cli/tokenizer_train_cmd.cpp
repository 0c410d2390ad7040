#include "anvil/cli/tokenizer_train_cmd.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "anvil/core/durable_file.h"
#include "anvil/core/error.h"
#include "anvil/data/bpe_trainer.h"
#include "anvil/data/brown.h"

namespace anvil {

namespace {

namespace fs = std::filesystem;

void print_usage() {
  std::printf(
      "usage: anvil tokenizer train --output tokenizer.json [--vocab-size N] [--input PATH ...] [--brown DIR]\n"
      "                             [--special TOKEN ...] [--pattern REGEX]\n\n"
      "Learns a byte-level BPE vocabulary and writes it as a Hugging Face tokenizer.json.\n\n"
      "  --vocab-size N    total vocabulary, bytes + merges + special tokens (default 2048)\n"
      "  --input PATH ...  text files, or folders searched for .txt files (several allowed)\n"
      "  --brown DIR       a Brown corpus folder (its 500 tagged files); the tags are stripped\n"
      "  --output PATH     where to write tokenizer.json (written to a temporary file, then renamed)\n"
      "  --special TOKEN   a special token; repeat for several. They take the top ids in the order\n"
      "                    given; the default is <|begin_of_text|> (BOS) then <|end_of_text|> (EOS)\n"
      "  --pattern REGEX   the pre-tokenizer regex (default: Llama 3's)\n\n"
      "examples:\n"
      "  anvil tokenizer train --input data/text/ --vocab-size 8192 --output tokenizer.json\n"
      "  anvil tokenizer train --brown data/brown --vocab-size 2048 --output brown.json\n");
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The files an --input names: the file itself, or a folder's .txt files (recursively, sorted).
std::vector<fs::path> expand_input(const std::string& path) {
  ANVIL_CHECK(fs::exists(path), "input '", path, "' does not exist; check the path given to --input");
  if (!fs::is_directory(path)) return {fs::path(path)};
  std::vector<fs::path> files;
  for (const auto& e : fs::recursive_directory_iterator(path))
    if (e.is_regular_file() && e.path().extension() == ".txt") files.push_back(e.path());
  ANVIL_CHECK(!files.empty(), "input folder '", path, "' holds no .txt files; give text files or a folder of them");
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace

int tokenizer_train_command(const std::vector<std::string>& args) {
  BpeTrainOptions options;
  std::vector<std::string> inputs, specials;
  std::string brown, output;
  bool specials_given = false;

  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    auto value = [&]() -> const std::string* {
      if (i + 1 >= args.size() || args[i + 1].rfind("--", 0) == 0) {
        std::fprintf(stderr, "error: %s needs a value (anvil tokenizer train --help)\n", a.c_str());
        return nullptr;
      }
      return &args[++i];
    };
    if (a == "--help" || a == "-h") {
      print_usage();
      return 0;
    } else if (a == "--vocab-size") {
      const std::string* v = value();
      if (!v) return 2;
      try {
        size_t used = 0;
        options.vocab_size = std::stoll(*v, &used);
        if (used != v->size()) throw std::invalid_argument("trailing characters");
      } catch (const std::exception&) {
        std::fprintf(stderr, "error: --vocab-size '%s' is not a whole number\n", v->c_str());
        return 2;
      }
    } else if (a == "--input") {
      const size_t before = inputs.size();
      while (i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0) inputs.push_back(args[++i]);
      if (inputs.size() == before) {
        std::fprintf(stderr, "error: --input needs at least one file or folder\n");
        return 2;
      }
    } else if (a == "--brown") {
      const std::string* v = value();
      if (!v) return 2;
      brown = *v;
    } else if (a == "--output") {
      const std::string* v = value();
      if (!v) return 2;
      output = *v;
    } else if (a == "--special") {
      const std::string* v = value();
      if (!v) return 2;
      specials.push_back(*v);
      specials_given = true;
    } else if (a == "--pattern") {
      const std::string* v = value();
      if (!v) return 2;
      options.pattern = *v;
    } else {
      std::fprintf(stderr, "error: unknown option '%s' (anvil tokenizer train --help lists them)\n", a.c_str());
      return 2;
    }
  }
  if (output.empty()) {
    std::fprintf(stderr, "error: --output PATH is required (where to write tokenizer.json)\n");
    return 2;
  }
  if (inputs.empty() && brown.empty()) {
    std::fprintf(stderr, "error: no training text: give --input PATH ... and/or --brown DIR\n");
    return 2;
  }
  if (specials_given) options.special_tokens = specials;

  try {
    const auto t0 = std::chrono::steady_clock::now();
    // Check the options before spending time on reading text.
    {
      const int64_t minimum = 256 + static_cast<int64_t>(options.special_tokens.size());
      ANVIL_CHECK(options.vocab_size >= minimum, "vocab size ", options.vocab_size,
                  " is too small: a byte-level BPE vocabulary needs the 256 byte tokens plus ",
                  options.special_tokens.size(), " special token(s), so at least ", minimum,
                  "; pass a larger --vocab-size");
    }
    WordCounter counter(options.pattern, options.special_tokens);
    int64_t files = 0, skipped_empty = 0;
    for (const auto& in : inputs) {
      const bool named_file = fs::exists(in) && !fs::is_directory(in);
      for (const auto& f : expand_input(in)) {
        const std::string text = read_file(f);
        if (text.empty()) {
          ANVIL_CHECK(!named_file, "input file '", f.string(), "' is empty; give a file with text in it");
          ++skipped_empty;
          continue;
        }
        counter.add_text(text);
        ++files;
      }
    }
    if (!brown.empty()) {
      for (const auto& doc : read_brown_corpus(brown)) {
        counter.add_text(doc.text);
        ++files;
      }
    }
    const double t_read = seconds_since(t0);
    ANVIL_CHECK(counter.total_words() > 0, "the input holds no text (", files, " file(s), ", skipped_empty,
                " empty); give files with text in them");
    std::printf("tokenizer train: read %lld file(s)%s, %.2f MB, %lld words (%zu distinct) in %.2f s, %.0f words/s\n",
                static_cast<long long>(files),
                skipped_empty ? (" (" + std::to_string(skipped_empty) + " empty skipped)").c_str() : "",
                static_cast<double>(counter.total_bytes()) / 1e6, static_cast<long long>(counter.total_words()),
                counter.counts().size(), t_read, static_cast<double>(counter.total_words()) / std::max(t_read, 1e-9));
    std::fflush(stdout);

    const auto t1 = std::chrono::steady_clock::now();
    int last_tenth = -1;
    options.progress = [&](int64_t done, int64_t wanted) {
      const int tenth = wanted > 0 ? static_cast<int>(done * 10 / wanted) : 10;
      if (tenth == last_tenth) return;
      last_tenth = tenth;
      const double t = seconds_since(t1);
      std::printf("  merges %lld/%lld (%d%%), %.2f s, %.0f merges/s\n", static_cast<long long>(done),
                  static_cast<long long>(wanted), tenth * 10, t, static_cast<double>(done) / std::max(t, 1e-9));
      std::fflush(stdout);
    };
    const BpeModel model = train_bpe(counter.counts(), options);
    write_bpe_tokenizer_json(model, output);

    std::printf("tokenizer train: wrote %s: vocab %lld = 256 bytes + %zu merges + %zu special", output.c_str(),
                static_cast<long long>(model.vocab_size()), model.merges.size(), model.special_tokens.size());
    for (size_t i = 0; i < model.special_tokens.size(); ++i)
      std::printf("%s%s=%d", i ? ", " : " (", model.special_tokens[i].c_str(),
                  model.first_special_id() + static_cast<int>(i));
    std::printf("%s\n", model.special_tokens.empty() ? "" : ")");
    std::printf("tokenizer train: merges took %.2f s, elapsed %.2f s\n", seconds_since(t1), seconds_since(t0));
    return 0;
  } catch (const Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}

}  // namespace anvil
