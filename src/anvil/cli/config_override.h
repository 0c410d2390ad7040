// A job configuration's override on a command line that takes a CONFIG.toml
// among other words (`anvil generate`, `anvil convert export`):
// --section.key value, --section.key=value, or a bare boolean --section.key.
#pragma once
#include <string>
#include <vector>

namespace anvil {

// When args[i] is such an override, appends it (and its value, when the next
// word is one) to `overrides`, moves i onto its last word and returns true.
inline bool take_config_override(const std::vector<std::string>& args, size_t& i, std::vector<std::string>& overrides) {
  const std::string& a = args[i];
  if (a.rfind("--", 0) != 0 || a.find('.') == std::string::npos) return false;
  overrides.push_back(a);
  if (a.find('=') == std::string::npos && i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0)
    overrides.push_back(args[++i]);
  return true;
}

}  // namespace anvil
