#include "anvil/train/checkpoint.h"

#include <zlib.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <vector>

#include "anvil/core/durable_file.h"
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

// state.json of a step folder, parsed, of a format this build reads.
nlohmann::json read_state(const fs::path& dir) {
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
  return state;
}

// The file's CRC32 equals the one state.json recorded.
void verify_file(const fs::path& dir, const nlohmann::json& state, const char* file) {
  ANVIL_CHECK(state.contains("crc32") && state["crc32"].contains(file), "'", (dir / "state.json").string(),
              "' records no CRC32 for ", file);
  const uint32_t want = state["crc32"][file].get<uint32_t>();
  ANVIL_CHECK(fs::exists(dir / file), "checkpoint file '", (dir / file).string(), "' is missing");
  const uint32_t got = file_crc32(dir / file);
  ANVIL_CHECK(got == want, "checkpoint file '", (dir / file).string(), "' is corrupt: CRC32 ", got,
              " but state.json recorded ", want);
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
  const nlohmann::json state = read_state(dir);
  ANVIL_CHECK(!state.value("model_only", false), "checkpoint '", dir.string(),
              "' is model-only (written by anvil convert import): it holds weights but no optimizer state or data ",
              "position, so no run can resume from it; train with another job.dump_folder and start from these ",
              "weights instead (docs/checkpoint.md, Hugging Face interop)");
  for (const char* f : kFiles) verify_file(dir, state, f);
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

CheckpointWeights load_checkpoint_weights(const std::string& step_dir) {
  const fs::path dir(step_dir);
  CheckpointWeights out;
  out.state = read_state(dir);
  verify_file(dir, out.state, kFiles[0]);
  out.tensors = load_safetensors((dir / kFiles[0]).string(), MemCategory::parameters).tensors;
  for (const auto& [name, t] : out.tensors)
    ANVIL_CHECK(t.dtype() == DType::f32, "'", (dir / kFiles[0]).string(), "': tensor '", name, "' is ",
                dtype_name(t.dtype()), "; checkpoints hold f32 master weights");
  return out;
}

size_t save_model_only_checkpoint(const std::string& folder, int64_t step,
                                  const std::vector<std::pair<std::string, Tensor>>& weights,
                                  const std::string& config_summary, const nlohmann::json& extra) {
  std::error_code ec;
  fs::create_directories(folder, ec);
  ANVIL_CHECK(!ec, "cannot create checkpoint folder '", folder, "': ", ec.message());
  const fs::path final_dir = fs::path(folder) / ("step-" + std::to_string(step)), tmp_dir = final_dir.string() + ".tmp";
  ANVIL_CHECK(!fs::exists(final_dir), "'", final_dir.string(), "' already exists; remove it or choose another folder");
  fs::remove_all(tmp_dir, ec);
  fs::create_directories(tmp_dir, ec);
  ANVIL_CHECK(!ec, "cannot create '", tmp_dir.string(), "': ", ec.message());
  save_safetensors((tmp_dir / kFiles[0]).string(), weights);
  fsync_path(tmp_dir / kFiles[0], false);

  nlohmann::ordered_json state;
  state["format_version"] = kFormatVersion;
  state["step"] = step;
  state["model_only"] = true;
  state["config"] = config_summary;
  for (const auto& [k, v] : extra.items()) state[k] = v;
  state["crc32"][kFiles[0]] = file_crc32(tmp_dir / kFiles[0]);
  write_file_durably(tmp_dir / "state.json", state.dump(2) + "\n");
  fsync_path(tmp_dir, true);
  fs::rename(tmp_dir, final_dir, ec);
  ANVIL_CHECK(!ec, "cannot rename '", tmp_dir.string(), "' to '", final_dir.string(), "': ", ec.message());
  fsync_path(folder, true);
  return fs::file_size(final_dir / kFiles[0]);
}

}  // namespace anvil
