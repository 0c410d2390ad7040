#include "anvil/train/gpu_job.h"

#include "anvil/core/error.h"

namespace anvil {

void check_gpu_job(const JobConfig& cfg, const ModelArgs& args, int world_size) {
  ANVIL_CHECK(world_size == 1, "a GPU trains in one process for now, and this job has ", world_size,
              " ranks; run one process, or train on the CPU");
  ANVIL_CHECK(!args.moe(), "mixture-of-experts models do not run on a GPU yet; train a dense flavour, or train on the "
              "CPU");
  ANVIL_CHECK(cfg.model.attn_mask_type != "block_causal",
              "block-causal attention does not run on a GPU yet; run with --model.attn_mask_type causal");
}

}  // namespace anvil
