#include "anvil/distributed/comm_volume.h"

#include "anvil/distributed/comm.h"

namespace anvil {

double ddp_bytes_per_step(const std::vector<ParamGroup>& groups, int n) {
  double bytes = 0;
  for (const ParamGroup& g : groups)
    for (const auto& [offset, numel] : g.data_parallel_runs)
      bytes += static_cast<double>(comm_bytes(CommOp::all_reduce, 4 * static_cast<uint64_t>(numel), n));
  return bytes;
}

double fsdp_bytes_per_step(const std::vector<ParamGroup>& groups, int n, int replicas, int compute_dtype_bytes,
                           ReshardPolicy reshard, int64_t micro_batches, bool gather_once, int expert_n) {
  const double passes = static_cast<double>(micro_batches);
  double bytes = 0, shard_elements = 0;
  for (size_t i = 0; i < groups.size(); ++i) {
    // The head's forward and backward are one fused pass: one gather, whatever the policy.
    const bool head = groups[i].module == ModuleKind::head;
    const bool kept = head || keep_after_forward(groups, static_cast<int>(i), reshard);
    const double gathers = gather_once ? 1.0 : passes * (kept ? 1 : 2);
    // The dense part over n ranks, the expert weights (if any) over expert_n.
    const int64_t experts = fsdp_expert_numel(groups[i]);
    for (int part = 0; part < (experts > 0 ? 2 : 1); ++part) {
      const int64_t numel = part == 0 ? fsdp_dense_numel(groups[i]) : experts;
      const int ranks = part == 0 ? n : expert_n;
      const int64_t per_rank = fsdp_shard_numel(numel, ranks);
      const uint64_t full = static_cast<uint64_t>(ranks * per_rank);
      shard_elements += static_cast<double>(per_rank);
      bytes += gathers * static_cast<double>(comm_bytes(CommOp::all_gather, full * compute_dtype_bytes, ranks));
      bytes += passes * static_cast<double>(comm_bytes(CommOp::reduce_scatter, full * 4, ranks));
    }
  }
  if (replicas > 1)
    bytes += static_cast<double>(comm_bytes(CommOp::all_reduce, static_cast<uint64_t>(4 * shard_elements), replicas));
  return bytes;
}

}  // namespace anvil
