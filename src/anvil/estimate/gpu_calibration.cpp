#include "anvil/estimate/gpu_calibration.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "anvil/core/error.h"

namespace anvil {

namespace {

// A positive number under `key` of `j`, or nothing when the key is absent.
std::optional<double> positive(const nlohmann::json& j, const char* key, const std::string& where) {
  if (!j.contains(key) || j.at(key).is_null()) return std::nullopt;
  ANVIL_CHECK(j.at(key).is_number() && j.at(key).get<double>() > 0, where, ": \"", key,
              "\" must be a positive number, not ", j.at(key).dump());
  return j.at(key).get<double>();
}

double required(const nlohmann::json& j, const char* key, const std::string& where) {
  const std::optional<double> v = positive(j, key, where);
  ANVIL_CHECK(v.has_value(), where, " has no \"", key, "\"");
  return *v;
}

// The host costs a calibration file may measure, by their names in the file and in GpuSoftware.
const std::vector<std::pair<const char*, double GpuSoftware::*>>& calibrated_software() {
  static const std::vector<std::pair<const char*, double GpuSoftware::*>> fields = {
      {"host_seconds_per_op", &GpuSoftware::host_seconds_per_op},
      {"host_seconds_per_launch", &GpuSoftware::host_seconds_per_launch},
      {"host_seconds_per_backward_node", &GpuSoftware::host_seconds_per_backward_node},
      {"host_seconds_per_accumulate", &GpuSoftware::host_seconds_per_accumulate},
      {"fsdp_hook_seconds", &GpuSoftware::fsdp_hook_seconds},
      {"dtensor_optimizer_seconds_per_tensor", &GpuSoftware::dtensor_optimizer_seconds_per_tensor},
      {"plain_optimizer_seconds_per_tensor", &GpuSoftware::plain_optimizer_seconds_per_tensor},
      {"dtensor_op_seconds", &GpuSoftware::dtensor_op_seconds},
  };
  return fields;
}

}  // namespace

size_t GpuCalibration::software_keys() { return calibrated_software().size(); }

GpuSoftware GpuCalibration::software_figures() const {
  GpuSoftware s = gpu_software();
  for (const auto& [name, field] : calibrated_software())
    if (const auto it = software.find(name); it != software.end()) s.*field = it->second;
  return s;
}

GpuCalibration GpuCalibration::load(const std::string& path) {
  std::ifstream in(path);
  ANVIL_CHECK(in.good(), "calibration file '", path,
              "' cannot be read: make one on the GPU with bench/gpu/calibrate.py (docs/estimator.md)");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw Error("calibration file '" + path + "' is not JSON: " + e.what());
  }
  ANVIL_CHECK(j.is_object(), "calibration file '", path, "' holds no JSON object");
  GpuCalibration c;
  c.source = path;
  for (const char* k : {"device", "torch", "date"})
    if (j.contains(k) && j.at(k).is_string()) c.source += std::string(c.source == path ? ": " : ", ") + j.at(k).get<std::string>();
  c.matmul_flops = positive(j, "matmul_flops", path);
  c.hbm_bandwidth = positive(j, "hbm_bandwidth", path);
  for (const auto& [name, field] : calibrated_software())
    if (const std::optional<double> v = positive(j, name, path)) c.software[name] = *v;
  if (j.contains("gemms")) {
    ANVIL_CHECK(j.at("gemms").is_array(), path, ": \"gemms\" must be an array");
    for (size_t i = 0; i < j.at("gemms").size(); ++i) {
      const nlohmann::json& g = j.at("gemms")[i];
      const std::string where = path + " gemms[" + std::to_string(i) + "]";
      const GemmShape s{required(g, "m", where), required(g, "k", where), required(g, "n", where)};
      c.gemm_seconds[s.key()] = required(g, "seconds", where);
    }
  }
  if (j.contains("attention")) {
    ANVIL_CHECK(j.at("attention").is_array(), path, ": \"attention\" must be an array");
    for (size_t i = 0; i < j.at("attention").size(); ++i) {
      const nlohmann::json& a = j.at("attention")[i];
      const std::string where = path + " attention[" + std::to_string(i) + "]";
      const AttentionShape s{required(a, "batch", where), required(a, "queries", where), required(a, "keys", where),
                             required(a, "heads", where), required(a, "head_dim", where)};
      c.attention_seconds[s.key()] = {required(a, "forward_seconds", where), required(a, "backward_seconds", where)};
    }
  }
  return c;
}

std::string PricedShapes::json() const {
  nlohmann::ordered_json j;
  j["gemms"] = nlohmann::ordered_json::array();
  auto whole = [](double x) { return static_cast<int64_t>(x); };  // shapes are whole numbers of elements
  for (const auto& [key, g] : gemms) j["gemms"].push_back({{"m", whole(g.m)}, {"k", whole(g.k)}, {"n", whole(g.n)}});
  j["attention"] = nlohmann::ordered_json::array();
  for (const auto& [key, a] : attention)
    j["attention"].push_back({{"batch", whole(a.batch)},
                              {"queries", whole(a.queries)},
                              {"keys", whole(a.keys)},
                              {"heads", whole(a.heads)},
                              {"head_dim", whole(a.head_dim)}});
  return j.dump(2) + "\n";
}

}  // namespace anvil
