// What the trainer says before it starts: the refusal of a run predicted not
// to fit, and the banner (model, precision, layout, peak FLOP rate, predicted memory).
#pragma once
#include <cstdint>
#include <string>

#include "anvil/core/cpu_peak.h"
#include "anvil/core/device.h"
#include "anvil/core/dtype.h"
#include "anvil/model/args.h"
#include "anvil/model/llama.h"
#include "anvil/train/config.h"
#include "anvil/train/parallel_dims.h"

namespace anvil {

// Rank 0 speaks for the job on the console; every other rank's stdout goes
// to <dump_folder>/logs/rank-<r>.log (appended to, so a resumed run keeps the
// history), where its own step lines show the same loss as rank 0's. Errors
// still reach stderr on every rank; the lines that say how a rank ended
// (a deadline, an abort) also go to that file, rank 0's included.
void route_rank_output(const JobConfig& cfg, const ParallelDims& par);

// 1234567 → "1,234,567".
std::string with_commas(int64_t n);

// What the run is measured against: MFU's peak and FLOPs per token, and this
// rank's predicted peak of tracked host memory (what its resident set is held to).
struct RunBasis {
  PeakFlops peak;
  double flops_per_token = 0;
  size_t predicted_peak_bytes = 0;
};

// Throws anvil::Error, before anything is allocated, when the run's predicted
// peak memory per process exceeds what is available (on a GPU: the dry run
// of the GPU path against the GPU's memory), saying what would fit;
// otherwise prints the banner. On a GPU MFU is against the GPU's dense bf16
// peak, and the predicted peak is the device's.
RunBasis check_fit_and_print_banner(const JobConfig& cfg, const ModelArgs& args, const ParallelDims& par,
                                    DType compute_dtype, const AcPolicy& ac, Device device = Device::cpu());

}  // namespace anvil
