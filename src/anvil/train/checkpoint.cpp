#include "anvil/train/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <vector>

#include "anvil/core/error.h"
#include "anvil/core/safetensors.h"

namespace anvil {

namespace fs = std::filesystem;

namespace {

constexpr int kFormatVersion = 1;
const char* const kFiles[] = {"model.safetensors", "optimizer.safetensors"};

uint32_t file_crc32(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  ANVIL_CHECK(in.good(), "cannot read '", p.string(), "'");
  std::vector<char> buf(1 << 20);
  uLong crc = crc32(0L, Z_NULL, 0);
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    const std::streamsize n = in.gcount();
    if (n > 0) crc = crc32(crc, reinterpret_cast<const Bytef*>(buf.data()), static_cast<uInt>(n));
  }
  return static_cast<uint32_t>(crc);
}

// Data reaches the disk before the rename makes it visible.
void fsync_path(const fs::path& p, bool directory) {
  const int fd = ::open(p.c_str(), directory ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  ANVIL_CHECK(fd >= 0, "cannot open '", p.string(), "' to sync it: ", std::strerror(errno));
  const int rc = ::fsync(fd);
  ::close(fd);
  ANVIL_CHECK(rc == 0, "fsync of '", p.string(), "' failed: ", std::strerror(errno), "; is the disk full?");
}

bool parse_step_dir(const std::string& name, int64_t& step) {
  if (name.rfind("step-", 0) != 0 || name.size() <= 5) return false;
  const std::string digits = name.substr(5);
  if (!std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) return false;
  step = std::stoll(digits);
  return true;
}

}  // namespace

Checkpointer::Checkpointer(std::string folder, int64_t keep_latest_k)
    : folder_(std::move(folder)), keep_latest_k_(keep_latest_k) {}

std::string Checkpointer::path_of(int64_t step) const {
  return (fs::path(folder_) / ("step-" + std::to_string(step))).string();
}

int64_t Checkpointer::latest_step() const {
  int64_t best = -1;
  std::error_code ec;
  if (!fs::is_directory(folder_, ec)) return -1;
  for (const auto& e : fs::directory_iterator(folder_, ec)) {
    int64_t step;
    // Only complete checkpoints: a step-N directory (never .tmp) holding its state.json.
    if (e.is_directory() && parse_step_dir(e.path().filename().string(), step) &&
        fs::exists(e.path() / "state.json"))
      best = std::max(best, step);
  }
  return best;
}

size_t Checkpointer::save(int64_t step, const ParamStore& params, const Tensor& adam_m, const Tensor& adam_v,
                          const nlohmann::json& loader_state, const std::string& config_summary) {
  std::error_code ec;
  fs::create_directories(folder_, ec);
  ANVIL_CHECK(!ec, "cannot create checkpoint folder '", folder_, "': ", ec.message());
  const fs::path final_dir = path_of(step), tmp_dir = final_dir.string() + ".tmp";
  fs::remove_all(tmp_dir, ec);
  fs::create_directories(tmp_dir, ec);
  ANVIL_CHECK(!ec, "cannot create '", tmp_dir.string(), "': ", ec.message());

  std::vector<std::pair<std::string, Tensor>> model, optimizer;
  for (size_t i = 0; i < params.specs().size(); ++i) {
    const ParamSpec& s = params.specs()[i];
    model.emplace_back(s.name, params.master(static_cast<int>(i)));
    optimizer.emplace_back(s.name + ".exp_avg", adam_m.slice(s.offset, s.numel()).view(s.shape));
    optimizer.emplace_back(s.name + ".exp_avg_sq", adam_v.slice(s.offset, s.numel()).view(s.shape));
  }
  save_safetensors((tmp_dir / kFiles[0]).string(), model);
  save_safetensors((tmp_dir / kFiles[1]).string(), optimizer);

  nlohmann::ordered_json state;
  state["format_version"] = kFormatVersion;
  state["step"] = step;
  state["loader"] = loader_state;
  state["config"] = config_summary;
  size_t bytes = 0;
  for (const char* f : kFiles) {
    fsync_path(tmp_dir / f, false);
    state["crc32"][f] = file_crc32(tmp_dir / f);
    bytes += fs::file_size(tmp_dir / f);
  }
  {
    std::ofstream out(tmp_dir / "state.json");
    out << state.dump(2) << "\n";
    out.flush();
    ANVIL_CHECK(out.good(), "writing '", (tmp_dir / "state.json").string(), "' failed; is the disk full?");
  }
  fsync_path(tmp_dir / "state.json", false);
  fsync_path(tmp_dir, true);
  fs::remove_all(final_dir, ec);  // a stale step-N from an earlier run of the same folder
  fs::rename(tmp_dir, final_dir, ec);
  ANVIL_CHECK(!ec, "cannot rename '", tmp_dir.string(), "' to '", final_dir.string(), "': ", ec.message());
  fsync_path(folder_, true);

  if (keep_latest_k_ > 0) {  // drop the oldest complete checkpoints beyond k
    std::vector<int64_t> steps;
    for (const auto& e : fs::directory_iterator(folder_)) {
      int64_t s;
      if (e.is_directory() && parse_step_dir(e.path().filename().string(), s)) steps.push_back(s);
    }
    std::sort(steps.begin(), steps.end());
    for (size_t i = 0; i + static_cast<size_t>(keep_latest_k_) < steps.size(); ++i) fs::remove_all(path_of(steps[i]));
  }
  return bytes;
}

nlohmann::json Checkpointer::load(int64_t step, ParamStore& params, Tensor& adam_m, Tensor& adam_v) const {
  const fs::path dir = path_of(step);
  const fs::path state_path = dir / "state.json";
  std::ifstream in(state_path);
  ANVIL_CHECK(in.good(), "checkpoint '", dir.string(), "' has no state.json; it is incomplete or not a checkpoint");
  nlohmann::json state;
  try {
    state = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw Error(detail::concat("'", state_path.string(), "' is not valid JSON: ", e.what()));
  }
  ANVIL_CHECK(state.value("format_version", 0) == kFormatVersion, "'", state_path.string(),
              "' has format version ", state.value("format_version", 0), "; this build reads version ",
              kFormatVersion);
  for (const char* f : kFiles) {
    const uint32_t want = state.at("crc32").at(f).get<uint32_t>();
    ANVIL_CHECK(fs::exists(dir / f), "checkpoint file '", (dir / f).string(), "' is missing");
    const uint32_t got = file_crc32(dir / f);
    ANVIL_CHECK(got == want, "checkpoint file '", (dir / f).string(), "' is corrupt: CRC32 ", got,
                " but state.json recorded ", want);
  }
  const SafetensorsFile model = load_safetensors((dir / kFiles[0]).string());
  const SafetensorsFile optimizer = load_safetensors((dir / kFiles[1]).string());
  auto copy_into = [&](const SafetensorsFile& file, const std::string& name, Tensor dst, const char* which) {
    auto it = file.tensors.find(name);
    ANVIL_CHECK(it != file.tensors.end(), "checkpoint '", dir.string(), "' has no tensor '", name,
                "'; it was saved from a different model (", which, ")");
    ANVIL_CHECK(it->second.shape() == dst.shape() && it->second.dtype() == DType::f32, "checkpoint '", dir.string(),
                "': tensor '", name, "' is ", shape_str(it->second.shape()), " ", dtype_name(it->second.dtype()),
                " but this model needs ", shape_str(dst.shape()),
                " f32; the checkpoint comes from a different model shape");
    dst.copy_from(it->second);
  };
  for (size_t i = 0; i < params.specs().size(); ++i) {
    const ParamSpec& s = params.specs()[i];
    copy_into(model, s.name, params.master(static_cast<int>(i)), kFiles[0]);
    copy_into(optimizer, s.name + ".exp_avg", adam_m.slice(s.offset, s.numel()).view(s.shape), kFiles[1]);
    copy_into(optimizer, s.name + ".exp_avg_sq", adam_v.slice(s.offset, s.numel()).view(s.shape), kFiles[1]);
  }
  ANVIL_CHECK(model.tensors.size() == params.specs().size(), "checkpoint '", dir.string(), "' holds ",
              model.tensors.size(), " tensors but this model has ", params.specs().size(),
              "; it comes from a different model");
  params.sync_compute_copy();
  return state.at("loader");
}

}  // namespace anvil
