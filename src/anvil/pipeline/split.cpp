#include "anvil/pipeline/split.h"

#include <algorithm>

#include "anvil/core/error.h"

namespace anvil {

std::pair<int, int> pipeline_stage_modules(const ModelArgs& args, const PipelineSplit& split, int stage) {
  const int n = static_cast<int>(args.n_layers), P = split.stages;
  if (!split.first_modules.empty()) {
    ANVIL_ASSERT(static_cast<int>(split.first_modules.size()) == P && stage >= 0 && stage < P);
    const size_t s = static_cast<size_t>(stage);
    return {split.first_modules[s], stage + 1 < P ? split.first_modules[s + 1] : n + 2};
  }
  const int in = split.first_stage_less_layers, out = split.last_stage_less_layers;
  ANVIL_CHECK(in >= 0 && out >= 0, "parallelism.pipeline_parallel_first_stage_less_layers and "
              "last_stage_less_layers must be 0 or more");
  const int units = n + in + out;  // the blocks, plus the embedding's and the head's worth
  ANVIL_CHECK(P >= 1 && P <= units, args.name, "/", args.flavor, " has ", n, " blocks (", units,
              " units counting the embedding as ", in, " and the head as ", out, ") to cut into ", P,
              " pipeline stages; use at most ", units, " stages");
  const int base = units / P, extra = units % P;
  auto first_unit = [&](int s) { return s * base + std::min(s, extra); };
  ANVIL_CHECK(in <= base + (extra > 0 ? 1 : 0) && out <= base, "pipeline stages of ", base, " or ", base + 1,
              " units cannot hold the embedding counted as ", in,
              " (parallelism.pipeline_parallel_first_stage_less_layers) and the head counted as ", out,
              " (last_stage_less_layers); lower them or use fewer stages");
  ANVIL_ASSERT(stage >= 0 && stage < P);
  // Unit u < in is the embedding's, in <= u < in + n block u − in, the rest the head's.
  const int first = stage == 0 ? 0 : 1 + first_unit(stage) - in;
  const int end = stage == P - 1 ? n + 2 : 1 + first_unit(stage + 1) - in;
  ANVIL_CHECK(first < end && (stage == 0 || first >= 1) && (stage == P - 1 || end <= n + 1), "pipeline stage ",
              stage, " of ", P, " would hold no block of ", args.name, "/", args.flavor,
              "; use fewer stages or change the first/last stage's counts");
  return {first, end};
}

std::string describe_pipeline_stages(const ModelArgs& args, const PipelineSplit& split,
                                     const PipePlacement* placement) {
  const int n = static_cast<int>(args.n_layers);
  std::string out;
  for (int s = 0; s < split.stages; ++s) {
    const auto [first, end] = pipeline_stage_modules(args, split, s);
    std::vector<std::string> parts;
    if (first == 0) parts.push_back("embedding");
    const int b0 = std::max(first, 1) - 1, b1 = std::min(end, n + 1) - 1;  // blocks [b0, b1)
    if (b1 - b0 == 1) parts.push_back(detail::concat("block ", b0));
    if (b1 - b0 > 1) parts.push_back(detail::concat("blocks ", b0, "-", b1 - 1));
    if (end == n + 2) parts.push_back("head");
    out += detail::concat(s ? "; " : "", "stage ", s);
    if (placement) out += detail::concat(" on rank ", placement->rank_of(s));
    out += ":";
    for (size_t i = 0; i < parts.size(); ++i) out += (i ? ", " : " ") + parts[i];
  }
  return out;
}

std::vector<ModuleRange> pipeline_rank_modules(const ModelArgs& args, const PipelineSplit& split,
                                               const PipePlacement& placement, int rank) {
  ANVIL_ASSERT(placement.stages() == split.stages, "a placement of ", placement.stages(), " stages for a split into ",
               split.stages);
  std::vector<ModuleRange> out;
  for (int s : placement.stages_of(rank)) {
    const auto [first, end] = pipeline_stage_modules(args, split, s);
    out.push_back({first, end});
  }
  return out;
}

}  // namespace anvil
