#include "anvil/train/gpu_job.h"

#include "anvil/core/error.h"
#include "anvil/estimate/gpu_hardware.h"

namespace anvil {

namespace {

bool contains(const std::string& s, const char* part) { return s.find(part) != std::string::npos; }

}  // namespace

int visible_gpus(std::string* why_none) {
  DeviceRuntime* runtime = nullptr;
  try {
    runtime = &device_runtime(Device::cuda());
  } catch (const Error&) {
    if (why_none) *why_none = "this binary was built without CUDA (configure with -DANVIL_CUDA=ON where the CUDA toolkit is)";
    return 0;
  }
  return runtime->device_count(why_none);
}

Device job_device(const JobConfig& cfg, std::string* why_cpu) {
  const std::string& d = cfg.job.device;
  if (d == "cpu") return Device::cpu();
  std::string why;
  const int gpus = visible_gpus(&why);
  if (d == "auto") {
    if (gpus > 0) return Device::cuda(0);
    if (why_cpu) *why_cpu = why;
    return Device::cpu();
  }
  ANVIL_CHECK(gpus > 0, "job.device cuda: no GPU to train on: ", why, ". Run with --job.device cpu");
  return Device::cuda(0);
}

void check_gpu_job(const ModelArgs& args, int world_size) {
  ANVIL_CHECK(world_size == 1, "a GPU trains in one process for now, and this job has ", world_size,
              " ranks; run one process, or train on the CPU");
  ANVIL_CHECK(!args.moe(), "mixture-of-experts models do not run on a GPU yet; train a dense flavour, or train on the "
              "CPU");
}

PeakFlops gpu_peak_flops(const std::string& name) {
  // The driver's names: "NVIDIA H200", "NVIDIA H100 80GB HBM3" (SXM5),
  // "NVIDIA A100-SXM4-80GB". An H100 PCIe or NVL has other peaks than the
  // planner's SXM entry, so it is not taken for one.
  std::string entry;
  if (contains(name, "H200")) entry = "h200";
  else if (contains(name, "H100") && (contains(name, "HBM3") || contains(name, "SXM"))) entry = "h100-80g";
  else if (contains(name, "A100") && contains(name, "80GB")) entry = "a100-80g";
  else if (contains(name, "A100") && contains(name, "40GB")) entry = "a100-40g";
  if (entry.empty())
    return {0, detail::concat("no MFU (no dense bf16 peak is known for the ", name, "; set metrics.peak_tflops)")};
  const GpuHardware& hw = gpu_hardware(entry);
  return {hw.peak_bf16_flops, detail::concat("the ", hw.description, "'s dense bf16 peak, ", hw.peak_bf16_flops / 1e12,
                                             " TFLOP/s")};
}

}  // namespace anvil
