#include "anvil/estimate/gpu_search.h"

#include <algorithm>

namespace anvil {

namespace {
// CP degrees are tried while each rank keeps this many tokens of a sequence:
// below it the chunks' attention is too small to pay for the gathers.
constexpr int64_t kMinCpTokens = 1024;
}  // namespace

GpuPlanResult search_gpu_layouts(const GpuRunSpec& base, const GpuHardware& hw, int64_t gpus) {
  GpuPlanResult out;
  const std::vector<AcPolicy> acs = {
      {AcMode::none, 2}, {AcMode::selective_op, 1}, {AcMode::selective_layer, 2}, {AcMode::full, 2}};
  for (int64_t tp = 1; tp <= hw.gpus_per_node && tp <= gpus; tp *= 2) {
    if (gpus % tp || base.model.n_heads % tp || base.model.n_kv_heads % tp) continue;
    for (int64_t cp = 1; cp <= gpus / tp && base.seq_len / cp >= kMinCpTokens; cp *= 2) {
      if ((gpus / tp) % cp || (cp > 1 && base.seq_len % (2 * cp))) continue;
      for (int64_t pp = 1; pp <= gpus / tp / cp && pp <= base.model.n_layers / 2; pp *= 2) {
        if ((gpus / tp / cp) % pp || (pp > 1 && base.model.tie_embeddings)) continue;
        const int64_t dp = gpus / tp / cp / pp;
        for (int64_t rep = 1; rep <= dp && (dp / rep) * cp >= 2; rep *= 2) {
          if (dp % rep) continue;
          for (const AcPolicy& ac : acs)
            for (int64_t lb = 1; lb <= 16; lb *= 2)
              for (int64_t mbs = 1; mbs <= (pp > 1 ? lb : 1); mbs *= 2) {
                if (pp > 1 && lb / mbs < pp) continue;
                GpuRunSpec s = base;
                s.tp = tp;
                s.cp = cp;
                s.pp = pp;
                s.dp_replicate = rep;
                s.dp_shard = dp / rep;
                s.ac = ac;
                s.local_batch = lb;
                s.microbatch_size = pp > 1 ? mbs : 1;
                s.pp_schedule = "1F1B";
                s.keep_pp_outputs = false;
                ++out.tried;
                const GpuStepEstimate e = estimate_gpu_run(s, hw);
                if (e.fits) out.rows.push_back({s, e});
              }
        }
      }
    }
  }
  std::stable_sort(out.rows.begin(), out.rows.end(), [](const GpuPlanRow& x, const GpuPlanRow& y) {
    return x.estimate.tokens_per_second_per_gpu > y.estimate.tokens_per_second_per_gpu;
  });
  return out;
}

}  // namespace anvil
