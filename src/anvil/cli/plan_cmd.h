// The GPU-cluster planner's commands (estimate/gpu_estimate.h): `anvil estimate
// CFG --hardware H --gpus N` (one layout) and `anvil plan CFG --hardware H
// --gpus N` (search the layouts that fit, ranked by predicted tokens/s per
// GPU); `anvil plan --seeds` prints the checks against seeds 000 and 001.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "anvil/train/config.h"

namespace anvil {

// The configuration's layout as torchtitan would run it on `gpus` GPUs of
// `hardware`: per-stage memory per GPU and step time, tokens/s per GPU, MFU;
// a table, or JSON with `json`; priced with the calibration file's rates when
// `calibration` names one. Returns the exit code.
// mean_document_tokens: block-causal attention over documents of that mean
// length (GpuRunSpec::mean_document_tokens); 0: the causal work.
int gpu_estimate_command(const JobConfig& cfg, const std::string& hardware, int64_t gpus, bool json,
                         const std::string& calibration = "", double mean_document_tokens = 0);

// anvil calibrate CFG [--section.key value ...] --hardware H --gpus N --shapes FILE
// writes the matrix-product and attention shapes the estimate of that run
// prices, for bench/gpu/calibrate.py to time on the GPU.
int calibrate_command(const std::vector<std::string>& args);

// anvil plan CFG [--section.key value ...] --hardware H --gpus N [--json] [--top K]
// anvil plan --seeds
int plan_command(const std::vector<std::string>& args);

}  // namespace anvil
