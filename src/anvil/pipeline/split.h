// The pipeline's stages: the module list (embedding, blocks, head) cut into
// contiguous slices, and which of them a rank holds. Pure arithmetic on the
// model's shape: the runtime (pipeline/executor.h), the layout's resolution
// and the GPU planner (estimate/gpu_estimate.cpp) all cut by it.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "anvil/model/args.h"
#include "anvil/model/llama.h"
#include "anvil/pipeline/schedule.h"

namespace anvil {

// How the module list is cut into contiguous stages (torchtitan's rule): the
// embedding counts as `first_stage_less_layers` blocks and the head as
// `last_stage_less_layers` (1 each by default: the first and last stage hold
// one block fewer), and the n_layers + those units spread as evenly as they
// go, the earlier stages taking the remainder.
// Or, when first_modules is set (parallelism.pipeline_parallel_auto_split,
// estimate/pipeline_split.h), stage s starts at module first_modules[s].
struct PipelineSplit {
  int stages = 1;
  int first_stage_less_layers = 1, last_stage_less_layers = 1;
  std::vector<int> first_modules = {};
};
// Stage `stage` holds modules [first, end) of the module list. Throws
// anvil::Error, naming the keys, when the stages cannot all hold a block's
// worth or the first or last stage cannot hold what it is told to count.
std::pair<int, int> pipeline_stage_modules(const ModelArgs& args, const PipelineSplit& split, int stage);
// The module ranges of the stages `rank` holds, in ascending order (the
// order a Llama numbers its stages).
std::vector<ModuleRange> pipeline_rank_modules(const ModelArgs& args, const PipelineSplit& split,
                                               const PipePlacement& placement, int rank);
// "stage 0: embedding, blocks 0-3; stage 1: blocks 4-5, head", for the banner;
// with a placement, each stage's rank too ("stage 0 on rank 0: ...").
std::string describe_pipeline_stages(const ModelArgs& args, const PipelineSplit& split,
                                     const PipePlacement* placement = nullptr);

}  // namespace anvil
