// A command-line count (--ranks 4, --gpus 64): the whole word a decimal
// integer of at least `min`, else anvil::Error naming the command and flag.
#pragma once
#include <charconv>
#include <cstdint>
#include <string>

#include "anvil/core/error.h"

namespace anvil {

inline int64_t parse_count_arg(const char* command, const std::string& flag, const std::string& value,
                               int64_t min = 1) {
  int64_t out = 0;
  const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), out);
  ANVIL_CHECK(ec == std::errc() && end == value.data() + value.size() && out >= min, command, ": ", flag,
              " takes ", min == 0 ? "a count" : "a positive integer", ", not '", value, "'");
  return out;
}

}  // namespace anvil
