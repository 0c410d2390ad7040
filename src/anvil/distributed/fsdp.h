// FSDP (ZeRO-3) and HSDP. Each parameter group (the embedding, each block,
// the head) is one flat range, padded to a multiple of the shard count; rank r
// of the dp_shard group keeps its 1/N slice of the group's fp32 master weights,
// their compute copy, the gradients and AdamW's moments, and nothing else
// between uses:
//   before a group's forward   all-gather its compute weights (the next
//                              group's gather is started now, to overlap);
//   after it                   free them (reshard_after_forward);
//   before its backward        gather again unless still held, and a zeroed
//                              full-group gradient buffer;
//   after its backward         reduce-scatter the gradients into this rank's
//                              shard (fp32), free the full buffers.
// HSDP adds dp_replicate copies of the whole sharded arrangement: the shard
// gradients are then all-reduced across the replicas (finish()).
//
// Under expert parallelism a block's expert weights (ParamSpec::expert: this
// rank's experts, which the other ranks of its ep group do not hold) are
// sharded apart from the rest of the group, over the expert_shard group (the
// dp_shard ranks holding the same experts; one rank when ep = dp_shard). A
// group's shard is then [its slice of the dense part | its slice of the
// experts], and its gathered buffers hold the dense part's n shards, then the
// experts' — the layout ParamStore binds (set_bound_layout). Each part is
// gathered and reduce-scattered over its own group.
//
// With gradient accumulation every micro-batch reduce-scatters into the shard:
// keeping unsharded gradients across micro-batches would cost a full model's
// fp32 gradients per rank, the very memory ZeRO-3 exists to save; the price is
// one reduce-scatter per micro-batch instead of per step.
#pragma once
#include <cstdint>
#include <vector>

#include "anvil/distributed/comm.h"
#include "anvil/distributed/comm_tracker.h"
#include "anvil/model/llama.h"
#include "anvil/model/params.h"
#include "anvil/model/reshard_policy.h"

namespace anvil {

// FSDP's layout rules, here once for FsdpParams and for the closed form of
// its traffic (comm_volume.h), so the two cannot drift apart; its reshard
// rule is model/reshard_policy.h's, shared with one process's per-group cast.
// Elements of each rank's slice of a group of `group_numel` over n shards: the
// 1/n share rounded up to a multiple of 32, so every shard stays 64-byte aligned.
int64_t fsdp_shard_numel(int64_t group_numel, int n);
// A group's elements outside expert weights (its data_parallel_runs), and in them.
int64_t fsdp_dense_numel(const ParamGroup& g);
inline int64_t fsdp_expert_numel(const ParamGroup& g) { return g.numel - fsdp_dense_numel(g); }

class FsdpParams : public ParamGroupHooks {
 public:
  // `model` is a ParamStore built without buffers (allocate = false) whose
  // groups this binds while they are in use. replicate: the HSDP replica group,
  // or null. expert_shard: the group sharding expert weights (needed when the
  // model has some: ParamSpec::expert).
  FsdpParams(ParamStore& model, Communicator& shard, Communicator* replicate, ReshardPolicy reshard,
             Communicator* expert_shard = nullptr);

  // This rank's shards: contiguous over the groups, group g at shard_offset(g).
  Tensor& master() { return master_; }
  Tensor& compute() { return compute_; }  // the master itself in fp32 compute
  Tensor& grads() { return grads_; }
  int64_t shard_numel() const { return shard_total_; }
  int64_t group_shard_numel(int g) const { return shard_numel_[static_cast<size_t>(g)]; }
  int64_t shard_offset(int g) const { return shard_offset_[static_cast<size_t>(g)]; }

  // Where parameter `param` (an index into the model's specs) lies across the
  // shards of its part (the dense weights', or the experts'): packed at
  // element `at` of the part, whose rank q of `comm` holds elements
  // [q·shard, (q + 1)·shard); this rank's slice of the part starts at
  // `slice_offset` of master(). So rank q holds the parameter's elements
  // [q·shard − at, (q + 1)·shard − at) ∩ [0, numel): one run, or none. Muon
  // gathers whole matrices from these runs (train/optimizer.h).
  struct ParamShards {
    Communicator* comm;
    int64_t at, shard, slice_offset;
  };
  ParamShards param_shards(int param) const;

  // Copies this rank's slices out of a full (flat) fp32 master buffer laid out
  // as ParamStore's, and refreshes the compute shard.
  void load_full_master(const Tensor& full_master);
  // The whole (tp rank's) model of a per-parameter fp32 state kept in the
  // shard layout — the master weights, AdamW's moments — gathered
  // (collective over the shard group).
  Tensor gather_full(const Tensor& shard_state);
  void scatter_full(const Tensor& full, Tensor& shard_state);  // this rank's slices of a full buffer
  void sync_compute_copy();

  // Keep every group's gathered weights from its first use in a step to
  // finish() instead of resharding them: one all-gather per group per step
  // rather than one or two per micro-batch, for the price of the stage's whole
  // weights held through the step. torchtitan's choice under pipeline
  // parallelism, whose micro-batches would otherwise gather every group again.
  void hold_gathered_for_step(bool on) { hold_for_step_ = on; }
  void zero_grad();
  void release_grads() { grads_ = Tensor(); }
  void before_forward(int group) override;
  void after_forward(int group) override;
  void before_backward(int group) override;
  void after_backward(int group) override;
  // Waits for the reduce-scatters in flight and, for HSDP, all-reduces the
  // shard gradients across replicas.
  void finish();
  CommTracker& tracker() { return tracker_; }

 private:
  // A group's two parts: its dense weights over shard_, its experts over
  // expert_shard_ (none in a dense group).
  struct Part {
    Communicator* comm = nullptr;
    int n = 1;                                      // ranks sharing it
    int64_t numel = 0;                              // elements (padded parameters)
    int64_t shard = 0;                              // this rank's slice
    int64_t shard_at = 0;                           // the slice's offset in the group's shard
    int64_t gathered_at = 0;                        // the n slices' offset in the gathered buffers
    std::vector<std::pair<int64_t, int64_t>> runs;  // {flat offset, numel}: where its elements lie, in order
  };
  struct Pending {
    Work work[2];
    Tensor full, partial[2];  // full gradients being reduced; partial receives this rank's sum of each part
    Tensor pieces[2];         // every rank's rows of this rank's shard, summed into partial
    int group;
    int id[2] = {-1, -1};  // in tracker_
  };
  struct Gathering {
    Work work[2];
    int id[2] = {-1, -1};  // in tracker_
  };
  const std::vector<Part>& parts(int group) const { return parts_[static_cast<size_t>(group)]; }
  void gather(int group, bool async);
  void wait_gather(int group);
  void complete(Pending& p);
  void progress();
  int layer_of(int group) const { return model_.groups()[static_cast<size_t>(group)].layer; }

  ParamStore& model_;
  Communicator& shard_;
  Communicator* replicate_;
  Communicator* expert_shard_;
  ReshardPolicy reshard_;
  bool hold_for_step_ = false;
  int n_;
  std::vector<int64_t> shard_numel_, shard_offset_;
  std::vector<std::vector<Part>> parts_;  // per group: the dense part, then the experts' if any
  struct ParamPlace {
    int group, part;
    int64_t at;  // in the part's packing
  };
  std::vector<ParamPlace> param_place_;  // per parameter of the model's specs
  int64_t shard_total_ = 0;
  Tensor master_, compute_, grads_;
  std::vector<Tensor> gathered_;    // per group: the full compute weights while held
  std::vector<Tensor> full_grads_;  // per group: the full gradients during its backward
  // Per group: backwards begun and not yet ended. A pipeline's zero-bubble
  // schedule starts micro-batch i + 1's input-gradient pass before micro-batch
  // i's weight pass ends; the full gradients are reduced when the last ends.
  std::vector<int> open_backwards_;
  std::vector<Gathering> gathering_;  // per group: a gather in flight
  CommTracker tracker_;
  std::vector<Pending> reducing_;
};

}  // namespace anvil
