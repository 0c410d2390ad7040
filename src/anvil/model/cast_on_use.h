// One process's bf16 weights cast per group while the group runs, as FSDP2's
// `fully_shard` does on one device (its all-gather over one rank is a cast of
// the fp32 parameters into bf16): a ParamStore with ComputeCopy::per_group
// keeps no bf16 copy, and these hooks make each group's before it runs and
// let it go after, by the same rule as FSDP's gathered weights
// (model/reshard_policy.h). The model state is then 16 bytes per parameter
// (fp32 weights, gradients and AdamW's two moments) plus the groups in use,
// not 18.
//
//   before a group's forward    cast its fp32 master into a bf16 buffer of
//                               the group (category parameters) and bind it;
//   after it                    free it, unless the group keeps it for its
//                               backward (the last block, by default);
//   before its backward         cast again unless kept;
//   after its backward          free it.
//
// The embedding is never cast: its forward gathers its rows from the fp32
// master, rounding each to bf16 as the cast would, so a 128k-entry
// vocabulary's table is not converted for B·T rows. A model whose head reads
// the embedding's weight (tied embeddings) casts that group with the head's.
// Other hooks (DDP's gradient reduction) run inside these, in the same order.
#pragma once
#include <vector>

#include "anvil/core/tensor.h"

#include "anvil/model/params.h"
#include "anvil/model/reshard_policy.h"

namespace anvil {

class CastOnUse : public ParamGroupHooks {
 public:
  // `params` has ComputeCopy::per_group and bf16 compute. tied_group: the
  // embedding's group when the head reads its weight, else -1. A Llama built
  // with ComputeCopy::per_group makes its own (LlamaOptions).
  CastOnUse(ParamStore& params, ReshardPolicy reshard, int tied_group);
  // Hooks to run as well, inside the casts (not owned; null: none).
  void set_inner(ParamGroupHooks* inner) { inner_ = inner; }

  void before_forward(int group) override;
  void after_forward(int group) override;
  void before_backward(int group) override;
  void after_backward(int group) override;

  // Frees every cast a group keeps (after a forward with no backward, such
  // as an evaluation, or when the master weights were replaced).
  void release();

 private:
  void make(int group);  // the casts `group` reads: its own (not the embedding's), and a tied head's
  void cast(int group);
  void free(int group);
  bool is_head(int group) const;

  ParamStore& params_;
  ReshardPolicy reshard_;
  int tied_group_;
  ParamGroupHooks* inner_ = nullptr;
  std::vector<Tensor> cast_;  // per group; undefined while not cast
};

}  // namespace anvil
