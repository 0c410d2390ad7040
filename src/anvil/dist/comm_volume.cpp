#include "anvil/dist/comm_volume.h"

#include "anvil/dist/comm.h"

namespace anvil {

double ddp_bytes_per_step(const std::vector<int64_t>& group_numel, int n) {
  double bytes = 0;
  for (int64_t g : group_numel) bytes += static_cast<double>(comm_bytes(CommOp::all_reduce, 4 * static_cast<uint64_t>(g), n));
  return bytes;
}

double fsdp_bytes_per_step(const std::vector<int64_t>& group_numel, int n, int replicas, int compute_dtype_bytes,
                           ReshardPolicy reshard, int64_t micro_batches) {
  const size_t groups = group_numel.size();
  double per_micro_batch = 0, shard_elements = 0;
  for (size_t i = 0; i < groups; ++i) {
    const int64_t per_rank = fsdp_shard_numel(group_numel[i], n);
    const uint64_t full = static_cast<uint64_t>(n * per_rank);
    shard_elements += static_cast<double>(per_rank);
    // The head's forward and backward are one fused pass: one gather, whatever the policy.
    const bool head = i + 1 == groups;
    const bool kept = head || fsdp_keep_after_forward(static_cast<int>(i), static_cast<int>(groups), reshard);
    const int gathers = kept ? 1 : 2;
    per_micro_batch += gathers * static_cast<double>(comm_bytes(CommOp::all_gather, full * compute_dtype_bytes, n));
    per_micro_batch += static_cast<double>(comm_bytes(CommOp::reduce_scatter, full * 4, n));
  }
  double bytes = per_micro_batch * static_cast<double>(micro_batches);
  if (replicas > 1)
    bytes += static_cast<double>(comm_bytes(CommOp::all_reduce, static_cast<uint64_t>(4 * shard_elements), replicas));
  return bytes;
}

}  // namespace anvil
