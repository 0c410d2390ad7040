#include "anvil/estimate/gpu_search.h"

#include <algorithm>
#include <map>
#include <set>
#include <string>

#include "anvil/core/error.h"

namespace anvil {

namespace {
// CP degrees are tried while each rank keeps this many tokens of a sequence:
// below it the chunks' attention is too small to pay for the gathers.
constexpr int64_t kMinCpTokens = 1024;
// Every named schedule Anvil trains.
constexpr const char* kSchedules[] = {"GPipe",        "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                                      "ZBVZeroBubble"};
}  // namespace

GpuPlanResult search_gpu_layouts(const GpuRunSpec& base, const GpuHardware& hw, int64_t gpus,
                                 const GpuCalibration* cal) {
  GpuPlanResult out;
  const std::vector<AcPolicy> acs = {
      {AcMode::none, 2}, {AcMode::selective_op, 1}, {AcMode::selective_layer, 2}, {AcMode::full, 2}};
  const int64_t L = base.model.n_layers;
  auto consider = [&](const GpuRunSpec& s) {
    ++out.tried;
    try {
      const GpuStepEstimate e = estimate_gpu_run(s, hw, cal);
      if (e.fits) out.rows.push_back({s, e});
    } catch (const Error&) {
      // A schedule that cannot run this many micro-batches on these ranks: not a layout.
    }
  };
  // A mixture of experts is priced without TP (gpu_estimate.h), with every
  // expert-parallel degree that divides its experts and dp_shard × cp.
  const bool moe = base.model.moe();
  for (int64_t tp = 1; tp <= hw.gpus_per_node && tp <= gpus && (tp == 1 || !moe); tp *= 2) {
    if (gpus % tp || base.model.n_heads % tp || base.model.n_kv_heads % tp) continue;
    for (int64_t cp = 1; cp <= gpus / tp && base.seq_len / cp >= kMinCpTokens; cp *= 2) {
      if ((gpus / tp) % cp || (cp > 1 && base.seq_len % (2 * cp))) continue;
      for (int64_t pp = 1; pp <= gpus / tp / cp && pp <= L / 2; pp *= 2) {
        if ((gpus / tp / cp) % pp || (pp > 1 && base.model.tie_embeddings)) continue;
        const int64_t dp = gpus / tp / cp / pp;
        // One GPU trains under bf16 autocast (no FSDP); more shard with FSDP.
        for (int64_t rep = 1; rep <= dp && ((dp / rep) * cp >= 2 || gpus == 1); rep *= 2) {
          if (dp % rep) continue;
          for (const AcPolicy& ac : acs)
            for (int64_t lb = 1; lb <= 16; lb *= 2)
              for (int64_t accum = 1; accum <= 4 && accum <= lb; accum *= 2)
                for (int64_t mbs = 1; mbs <= (pp > 1 ? lb / accum : 1); mbs *= 2) {
                  const int64_t m = lb / accum / mbs;
                  if (pp > 1 && m < pp) continue;
                  GpuRunSpec s = base;
                  s.tp = tp;
                  s.cp = cp;
                  s.pp = pp;
                  s.dp_replicate = rep;
                  s.dp_shard = dp / rep;
                  s.ac = ac;
                  s.local_batch = lb;
                  s.grad_accum = accum;
                  s.microbatch_size = pp > 1 ? mbs : 1;
                  s.keep_pp_outputs = false;
                  s.pp_schedule_csv.clear();
                  s.pp_stages_per_rank = 0;
                  const std::vector<std::string> rotations =
                      cp > 1 ? std::vector<std::string>{"allgather", "ring"} : std::vector<std::string>{base.cp_rotate};
                  for (int64_t ep = 1; ep == 1 || (moe && ep <= (dp / rep) * cp); ep *= 2) {
                    if (ep > 1 && (((dp / rep) * cp) % ep || base.model.num_experts % ep)) continue;
                    s.ep = ep;
                    for (const std::string& rotate : rotations) {
                      s.cp_rotate = rotate;
                      if (pp == 1) {
                        consider(s);
                        continue;
                      }
                      for (const char* schedule : kSchedules) {
                        s.pp_schedule = schedule;
                        // Two stages per rank for the looped and V schedules, each at least two blocks.
                        const bool looped = std::string(schedule) != "1F1B" && std::string(schedule) != "GPipe";
                        if (looped && 2 * pp > L / 2) continue;
                        consider(s);
                      }
                    }
                  }
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

namespace {
constexpr double kSameSpeed = 0.99;

std::string layout_key(const GpuRunSpec& s) {
  return std::to_string(s.dp_shard) + "/" + std::to_string(s.dp_replicate) + "/" + std::to_string(s.ep) + "/" +
         std::to_string(s.cp) + "/" + (s.cp > 1 ? s.cp_rotate : "") + "/" + std::to_string(s.tp) + "/" +
         std::to_string(s.pp) + "/" + (s.pp > 1 ? s.pp_schedule : "");
}
}  // namespace

std::vector<GpuPlanRow> distinct_layouts(const std::vector<GpuPlanRow>& rows) {
  // Per layout, its fastest row; then, among that layout's rows within 1% of
  // it, the one with the smallest global batch (fewest accumulation steps):
  // the same speed from a smaller batch is the better choice.
  std::map<std::string, double> best;
  for (const GpuPlanRow& r : rows) {
    double& b = best[layout_key(r.spec)];
    b = std::max(b, r.estimate.tokens_per_second_per_gpu);
  }
  std::map<std::string, const GpuPlanRow*> chosen;
  for (const GpuPlanRow& r : rows) {
    const std::string key = layout_key(r.spec);
    if (r.estimate.tokens_per_second_per_gpu < kSameSpeed * best[key]) continue;
    const GpuPlanRow*& c = chosen[key];
    if (!c || r.spec.local_batch < c->spec.local_batch ||
        (r.spec.local_batch == c->spec.local_batch && r.spec.grad_accum < c->spec.grad_accum))
      c = &r;
  }
  std::vector<GpuPlanRow> out;
  for (const auto& [key, r] : chosen) out.push_back(*r);
  std::stable_sort(out.begin(), out.end(), [](const GpuPlanRow& x, const GpuPlanRow& y) {
    return x.estimate.tokens_per_second_per_gpu > y.estimate.tokens_per_second_per_gpu;
  });
  return out;
}

std::vector<GpuPlanRow> fastest_per_schedule(const std::vector<GpuPlanRow>& rows) {
  std::vector<GpuPlanRow> out;
  std::set<std::string> seen;
  for (const GpuPlanRow& r : distinct_layouts(rows))
    if (r.spec.pp > 1 && seen.insert(r.spec.pp_schedule).second) out.push_back(r);
  return out;
}

}  // namespace anvil
