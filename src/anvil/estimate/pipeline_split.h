// Where to cut the model into pipeline stages so that no stage is much slower
// or fuller than the others (parallelism.pipeline_parallel_auto_split). Each
// module — the embedding, each block, the head — is priced for one micro-batch
// in compute (its forward and backward FLOPs, the recomputed forward under
// full checkpointing) and in memory (its weights, gradients and AdamW state,
// plus the activations it keeps times the micro-batches its stage holds at
// once under the schedule). The embedding costs little compute but V·D
// weights; a 128K-vocabulary head costs both (torchtitan #2093: worth several
// blocks). The cut minimises the largest stage's cost, a stage's cost being
// the larger of its compute share and its memory share (each over the mean
// per stage), exactly by dynamic programming over the contiguous cuts.
#pragma once
#include <vector>

#include "anvil/estimate/memory.h"
#include "anvil/model/args.h"

namespace anvil {

struct ModuleCost {
  // FLOPs per micro-batch of the forward pass, the input-gradient pass (with
  // any recomputed forward) and the weight-gradient pass — the pipeline's F,
  // I and W; the head runs its whole fused pass in I, the embedding's
  // backward is all W.
  double forward = 0, backward_input = 0, backward_weight = 0;
  double weight_bytes = 0;      // weights, gradients, optimizer state
  double activation_bytes = 0;  // kept from forward to backward, per micro-batch in flight
  double flops() const { return forward + backward_input + backward_weight; }
};

// The modules' costs in module order (embedding, blocks, head) for micro-batches of `shape`.
std::vector<ModuleCost> pipeline_module_costs(const ModelArgs& args, const TrainShape& shape);

// The first module of each of in_flight.size() stages (the first is 0): the
// contiguous cut minimising the largest stage's cost, in_flight[s] being the
// micro-batches stage s holds at once. Throws anvil::Error when there are
// fewer modules than stages.
std::vector<int> balanced_pipeline_cut(const std::vector<ModuleCost>& costs, const std::vector<int>& in_flight);

}  // namespace anvil
