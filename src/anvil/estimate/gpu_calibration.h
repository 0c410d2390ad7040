// Rates measured on the user's own GPU, for the planner (estimate/gpu_estimate.h)
// to use instead of the published figures of estimate/gpu_hardware.h.
//
// The planner prices every matrix product and attention call by its shape. To
// calibrate, `anvil calibrate CONFIG --gpus N --shapes FILE` writes the shapes
// the estimate of that run prices (found by running the estimate itself, so
// the list cannot drift from the model), a program on the GPU machine times
// each of them and the machine's general rates (bench/gpu/calibrate.py, with
// PyTorch, until Anvil's own CUDA kernels do it) into a calibration file, and
// `anvil estimate|plan ... --calibration FILE` prices with it, saying which
// rates came from the file and which from the table.
#pragma once
#include <map>
#include <optional>
#include <string>
#include <tuple>

#include "anvil/estimate/gpu_hardware.h"

namespace anvil {

// A bf16 product (M x K) times (K x N), fp32 accumulation.
struct GemmShape {
  double m = 0, k = 0, n = 0;
  auto key() const { return std::tuple{m, k, n}; }
};

// Causal flash attention over `batch` sequences of `queries` query tokens
// against `keys` key tokens, `heads` query heads of head_dim (GQA's key and
// value heads repeated to `heads` first, as torchtitan does), bf16.
struct AttentionShape {
  double batch = 0, queries = 0, keys = 0, heads = 0, head_dim = 0;
  auto key() const { return std::tuple{batch, queries, keys, heads, head_dim}; }
};

struct GpuCalibration {
  std::string source;  // the file, and what it says it measured on ("NVIDIA H200, torch 2.11.0, 2026-11-27")
  std::optional<double> matmul_flops;         // the best bf16 GEMM rate over its square sizes, FLOP/s
  std::optional<double> hbm_bandwidth;        // a large device-to-device copy, bytes moved per second (read + write)
  // Eager PyTorch's host costs measured on this machine, by GpuSoftware's
  // names (host_seconds_per_op, host_seconds_per_launch, ...; gpu_hardware.h):
  // each replaces the published figure it names.
  std::map<std::string, double> software;
  std::map<std::tuple<double, double, double>, double> gemm_seconds;
  std::map<std::tuple<double, double, double, double, double>, std::pair<double, double>> attention_seconds;  // fwd, bwd

  // Reads a calibration file (bench/gpu/calibrate.py's JSON); throws anvil::Error naming what is wrong.
  static GpuCalibration load(const std::string& path);
  // The published software figures with this file's in their place.
  GpuSoftware software_figures() const;
  // How many host costs a file can give (GpuSoftware's eager PyTorch fields).
  static size_t software_keys();
};

// The shapes one estimate priced, in the order first met (for `anvil calibrate --shapes`).
struct PricedShapes {
  std::map<std::tuple<double, double, double>, GemmShape> gemms;
  std::map<std::tuple<double, double, double, double, double>, AttentionShape> attention;
  std::string json() const;
};

}  // namespace anvil
