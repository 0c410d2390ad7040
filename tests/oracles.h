// The oracles' environment (scripts/setup_oracles.sh): torch and Hugging Face
// transformers from PyPI, with the project's other outside oracles, in a
// virtual environment outside the checkout, found by the rule that
// scripts/oracles_dir.sh prints. A test that needs it starts with
// ANVIL_NEED_ORACLES(python): under CI (CI set) a missing environment fails
// the test, as the set-up must provide it there; elsewhere the test is skipped,
// naming the script that makes it.
#pragma once
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <string>

namespace anvil::testing {

inline std::filesystem::path oracles_dir() {
  if (const char* dir = std::getenv("ANVIL_ORACLES"); dir != nullptr && *dir != '\0') return dir;
  if (const char* cache = std::getenv("XDG_CACHE_HOME"); cache != nullptr && *cache != '\0')
    return std::filesystem::path(cache) / "anvil" / "oracles";
  const char* home = std::getenv("HOME");
  return std::filesystem::path(home != nullptr ? home : "/root") / ".cache" / "anvil" / "oracles";
}

// The environment's Python, or "" with `missing` saying what is wanting; the
// imports are tried once per process.
inline std::string oracle_python(std::string& missing) {
  static const std::pair<std::string, std::string> found = [] {
    const std::filesystem::path python = oracles_dir() / "bin" / "python";
    if (!std::filesystem::exists(python))
      return std::pair<std::string, std::string>{
          "", "the oracles' environment " + oracles_dir().string() + " is missing: scripts/setup_oracles.sh makes it"};
    std::string cmd = "'";  // built in steps: GCC 12 warns falsely (-Wrestrict) on "'" + s + "..."
    cmd += python.string();
    cmd += "' -c 'import torch, transformers' > /dev/null 2>&1";
    if (std::system(cmd.c_str()) != 0)
      return std::pair<std::string, std::string>{"", "the oracles' environment " + oracles_dir().string() +
                                                         " cannot import torch and transformers: "
                                                         "scripts/setup_oracles.sh installs them"};
    return std::pair<std::string, std::string>{python.string(), ""};
  }();
  missing = found.second;
  return found.first;
}

inline bool under_ci() {
  const char* ci = std::getenv("CI");
  return ci != nullptr && *ci != '\0';
}

}  // namespace anvil::testing

#define ANVIL_NEED_ORACLES(python)                                                                                  \
  std::string python;                                                                                               \
  do {                                                                                                              \
    std::string missing_;                                                                                           \
    python = ::anvil::testing::oracle_python(missing_);                                                             \
    if (python.empty()) {                                                                                           \
      if (::anvil::testing::under_ci()) FAIL() << missing_ << ". CI is set, and there the set-up must provide it."; \
      GTEST_SKIP() << missing_;                                                                                     \
    }                                                                                                               \
  } while (false)
