#include "anvil/model/activation_checkpoint.h"

#include <stdexcept>

#include "anvil/core/error.h"

namespace anvil {

AcPolicy parse_ac_policy(const std::string& mode, const std::string& option) {
  if (mode == "none") return {AcMode::none, 1};
  if (mode == "full") return {AcMode::full, 1};
  ANVIL_CHECK(mode == "selective", "activation_checkpoint.mode = \"", mode, "\" is not one of: none, selective, full");
  if (option == "op") return {AcMode::selective_op, 1};
  int k = 0;
  try {
    size_t used = 0;
    k = std::stoi(option, &used);
    if (used != option.size()) k = 0;
  } catch (const std::exception&) {
    k = 0;
  }
  ANVIL_CHECK(k >= 1, "activation_checkpoint.selective_ac_option = \"", option,
              "\" must be \"op\" or a positive integer k (checkpoint every k-th block)");
  return {AcMode::selective_layer, k};
}

const char* ac_mode_name(AcMode m) {
  switch (m) {
    case AcMode::none: return "none";
    case AcMode::selective_layer: return "selective layer";
    case AcMode::selective_op: return "selective op";
    case AcMode::full: return "full";
  }
  return "?";
}

}  // namespace anvil
