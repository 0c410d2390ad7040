#include "anvil/model/activation_checkpoint.h"

namespace anvil {

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
