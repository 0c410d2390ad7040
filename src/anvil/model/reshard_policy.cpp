#include "anvil/model/reshard_policy.h"

#include "anvil/core/error.h"

namespace anvil {

ReshardPolicy parse_reshard_policy(const std::string& s) {
  if (s == "default") return ReshardPolicy::default_policy;
  if (s == "always") return ReshardPolicy::always;
  if (s == "never") return ReshardPolicy::never;
  throw Error(detail::concat("parallelism.fsdp_reshard_after_forward is '", s, "'; use default, always or never"));
}

bool keep_after_forward(const std::vector<ParamGroup>& groups, int group, ReshardPolicy reshard) {
  switch (reshard) {
    case ReshardPolicy::never: return true;
    case ReshardPolicy::always: return false;
    case ReshardPolicy::default_policy: break;
  }
  // The last block's weights are needed again at once by the backward.
  const size_t next = static_cast<size_t>(group) + 1;
  return next < groups.size() && groups[next].module == ModuleKind::head;
}

}  // namespace anvil
