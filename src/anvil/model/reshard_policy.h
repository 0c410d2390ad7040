// When a parameter group's compute weights are let go after its forward:
// FSDP's gathered weights (distributed/fsdp.h) and one process's per-group
// bf16 cast (model/cast_on_use.h) follow the same rule, torchtitan's
// `reshard_after_forward`, so the key that sets it means one thing.
#pragma once
#include <string>
#include <vector>

#include "anvil/model/params.h"

namespace anvil {

enum class ReshardPolicy { default_policy, always, never };
// parallelism.fsdp_reshard_after_forward: "default", "always" or "never".
ReshardPolicy parse_reshard_policy(const std::string& s);

// Whether group `group` keeps its compute weights from its forward to its
// backward instead of making them again: under "never" every group, under
// "always" none, by default the block just before the head, whose backward
// comes at once. (The head's forward and backward are one pass: it makes them once.)
bool keep_after_forward(const std::vector<ParamGroup>& groups, int group, ReshardPolicy reshard);

}  // namespace anvil
