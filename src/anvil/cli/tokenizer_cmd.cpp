#include "anvil/cli/tokenizer_cmd.h"

#include <chrono>
#include <cstdio>
#include <iostream>
#include <iterator>
#include <memory>
#include <sstream>

#include "anvil/core/did_you_mean.h"
#include "anvil/core/error.h"
#include "anvil/data/bpe_tokenizer.h"

namespace anvil {

namespace {

constexpr const char* kUsage =
    "usage: anvil tokenizer encode --tokenizer PATH [--bos] [--eos] [--stats]   (UTF-8 text on stdin -> ids;\n"
    "       --stats prints the encoding time and MB/s as JSON on stderr)\n"
    "       anvil tokenizer decode --tokenizer PATH                   (ids on stdin -> text)\n"
    "PATH is a Hugging Face tokenizer.json, a tiktoken file, or \"bytes\".\n"
    "       anvil tokenizer train --help   learns a tokenizer.json from text\n\n"
    "examples:\n"
    "  echo 'Hello, world' | anvil tokenizer encode --tokenizer bytes --bos\n"
    "  echo '72 105' | anvil tokenizer decode --tokenizer tokenizer.json\n";

bool wants_help(const std::vector<std::string>& args) {
  for (const std::string& a : args)
    if (a == "--help" || a == "-h") return true;
  return false;
}

std::string read_stdin() {
  std::ostringstream ss;
  ss << std::cin.rdbuf();
  return ss.str();
}

}  // namespace

int tokenizer_command(const std::vector<std::string>& args) {
  if (args.empty() || wants_help(args)) {  // `anvil tokenizer encode --help` too
    std::fputs(kUsage, args.empty() ? stderr : stdout);
    return args.empty() ? 2 : 0;
  }
  const std::string& sub = args[0];
  if (sub != "encode" && sub != "decode") {
    const std::string guess = nearest_word({"encode", "decode", "train"}, sub, 2);
    std::fprintf(stderr, "anvil tokenizer: unknown sub-command \"%s\"%s (expected encode, decode or train)\n%s",
                 sub.c_str(), guess.empty() ? "" : ("; did you mean \"" + guess + "\"?").c_str(), kUsage);
    return 2;
  }
  std::string path;
  bool bos = false, eos = false, stats = false;
  for (size_t i = 1; i < args.size(); ++i) {
    if (args[i] == "--tokenizer" && i + 1 < args.size()) {
      path = args[++i];
    } else if (args[i].rfind("--tokenizer=", 0) == 0) {
      path = args[i].substr(12);
    } else if (sub == "encode" && args[i] == "--bos") {
      bos = true;
    } else if (sub == "encode" && args[i] == "--eos") {
      eos = true;
    } else if (sub == "encode" && args[i] == "--stats") {
      stats = true;
    } else {
      std::fprintf(stderr, "anvil tokenizer %s: unexpected argument \"%s\"\n%s", sub.c_str(), args[i].c_str(), kUsage);
      return 2;
    }
  }
  if (path.empty()) {
    std::fprintf(stderr, "anvil tokenizer %s: --tokenizer PATH is required\n%s", sub.c_str(), kUsage);
    return 2;
  }
  try {
    const std::unique_ptr<Tokenizer> tok = load_tokenizer(path);
    if (sub == "encode") {
      std::vector<int32_t> ids;
      if (bos) {
        ANVIL_CHECK(tok->bos_id() >= 0, "--bos: tokenizer ", path, " has no BOS token");
        ids.push_back(tok->bos_id());
      }
      const std::string text = read_stdin();
      const auto t0 = std::chrono::steady_clock::now();
      const std::vector<int32_t> body = tok->encode(text);
      if (stats) {  // the encoding alone, without loading the tokenizer or printing ids
        const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::fprintf(stderr, "{\"bytes\": %zu, \"tokens\": %zu, \"seconds\": %.6f, \"mb_per_s\": %.3f}\n",
                     text.size(), body.size(), secs, static_cast<double>(text.size()) / secs / 1e6);
      }
      ids.insert(ids.end(), body.begin(), body.end());
      if (eos) {
        ANVIL_CHECK(tok->eos_id() >= 0, "--eos: tokenizer ", path, " has no EOS token");
        ids.push_back(tok->eos_id());
      }
      std::string out;
      for (size_t i = 0; i < ids.size(); ++i) {
        if (i) out.push_back(' ');
        out += std::to_string(ids[i]);
      }
      out.push_back('\n');
      std::fwrite(out.data(), 1, out.size(), stdout);
    } else {
      const std::string in = read_stdin();
      std::vector<int32_t> ids;
      std::istringstream words(in);
      std::string w;
      size_t n = 0;
      while (words >> w) {
        ++n;
        size_t used = 0;
        long long v = -1;
        try {
          v = std::stoll(w, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        ANVIL_CHECK(used == w.size() && v >= 0 && v <= INT32_MAX, "word ", n, " of stdin (\"", w,
                    "\") is not a token id; give whitespace-separated non-negative integers");
        ANVIL_CHECK(v < tok->vocab_size(), "id ", v, " (word ", n,
                    " of stdin) is outside the vocabulary of ", path, " (", tok->vocab_size(), " ids)");
        ids.push_back(static_cast<int32_t>(v));
      }
      const std::string text = tok->decode(ids);
      std::fwrite(text.data(), 1, text.size(), stdout);
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "anvil tokenizer %s: %s\n", sub.c_str(), e.what());
    return 1;
  }
  return 0;
}

}  // namespace anvil
