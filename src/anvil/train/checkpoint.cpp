#include "anvil/train/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <vector>

#include "anvil/core/dry_run.h"
#include "anvil/core/durable_file.h"
#include "anvil/core/error.h"
#include "anvil/core/profiler.h"
#include "anvil/core/safetensors.h"
#include "anvil/estimate/memory.h"
#include "anvil/train/checkpoint_folder.h"

namespace anvil {

namespace fs = std::filesystem;

namespace {

constexpr const char* kModelFile = "model.safetensors";
constexpr const char* kOptimizerFile = "optimizer.safetensors";
constexpr const char* kConfigFile = "config.toml";

void copy_into(const SafetensorsFile& file, const fs::path& path, const std::string& name, Tensor dst) {
  auto it = file.tensors.find(name);
  ANVIL_CHECK(it != file.tensors.end(), "checkpoint file '", path.string(), "' has no tensor '", name,
              "'; it was saved from a different model");
  ANVIL_CHECK(it->second.shape() == dst.shape(), "checkpoint file '", path.string(), "': tensor '", name, "' is ",
              shape_str(it->second.shape()), " but this model needs ", shape_str(dst.shape()),
              "; the checkpoint comes from a different model shape");
  ANVIL_CHECK(it->second.dtype() == DType::f32 || it->second.dtype() == DType::bf16, "checkpoint file '",
              path.string(), "': tensor '", name, "' is ", dtype_name(it->second.dtype()), "; expected f32 or bf16");
  dst.copy_from(it->second);
}

Tensor spec_view(const Tensor& flat, const ParamSpec& s) { return flat.slice(s.offset, s.numel()).view(s.shape); }

void load_model_file(const fs::path& dir, const std::vector<ParamSpec>& specs, const Tensor& master_flat) {
  const fs::path path = dir / kModelFile;
  const SafetensorsFile model = load_safetensors(path.string());
  for (const ParamSpec& s : specs) copy_into(model, path, s.name, spec_view(master_flat, s));
  ANVIL_CHECK(model.tensors.size() == specs.size(), "checkpoint file '", path.string(), "' holds ",
              model.tensors.size(), " tensors but this model has ", specs.size(), "; it comes from a different model");
}

// A test hook: ANVIL_FAULT_KILL_DURING_SAVE=<step> makes the process SIGKILL
// itself halfway through writing that step's weights, as a power cut would.
int64_t kill_during_save_step() {
  const char* v = std::getenv("ANVIL_FAULT_KILL_DURING_SAVE");
  return v != nullptr ? std::atoll(v) : -1;
}

}  // namespace

struct Checkpointer::Pending {
  int64_t step = 0;
  bool model_only = false;
  std::vector<std::pair<std::string, Tensor>> model, optimizer;
  std::string optimizer_name;
  CheckpointMeta meta;
  Tensor staging;  // the host buffer a GPU's tensors come over through, piece by piece (synchronous saves)
};

namespace {
// The pieces a synchronous save of a GPU's tensors brings to the host at a
// time: the writer's own piece size, or the largest tensor where that is smaller.
constexpr size_t kStagingBytes = size_t{64} << 20;
}  // namespace

Checkpointer::Checkpointer(std::string folder, int64_t keep_latest_k, bool async)
    : folder_(std::move(folder)), keep_latest_k_(keep_latest_k), async_(async) {}

Checkpointer::~Checkpointer() {
  try {
    wait();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "anvil: error: %s\n", e.what());
  }
}

void Checkpointer::wait() {
  if (writer_.joinable()) writer_.join();
  held_.reset();  // freed here, on the training thread, after the writer is done
  if (writer_error_) std::rethrow_exception(std::exchange(writer_error_, nullptr));
}

std::string Checkpointer::path_of(int64_t step) const {
  return (fs::path(folder_) / ("step-" + std::to_string(step))).string();
}

int64_t Checkpointer::latest_step() const {
  int64_t best = -1;
  for (const StepFolder& f : scan_checkpoint_folder(folder_))
    if (f.kind == StepFolder::Kind::resumable) best = f.step;
  return best;
}

void Checkpointer::save(int64_t step, const ParamStore& params, const Tensor* adam_m, const Tensor* adam_v,
                        const CheckpointMeta& meta, DType model_dtype, const CheckpointOptimizer& optimizer) {
  save(step, params.specs(), const_cast<ParamStore&>(params).master_flat(), adam_m, adam_v, meta, model_dtype,
       optimizer);
}

void Checkpointer::save(int64_t step, const std::vector<ParamSpec>& specs, const Tensor& master_flat,
                        const Tensor* adam_m, const Tensor* adam_v, const CheckpointMeta& meta, DType model_dtype,
                        const CheckpointOptimizer& optimizer) {
  wait();  // one save in flight at a time
  const ScopedPhase phase(SpanCategory::checkpoint, "checkpoint.copy");
  Pending p;
  p.step = step;
  p.model_only = adam_m == nullptr;
  p.meta = meta;
  p.optimizer_name = optimizer.name;
  ANVIL_CHECK(p.model_only || model_dtype == DType::f32, "a resumable checkpoint keeps fp32 weights");
  // A synchronous save writes straight from the live tensors (a GPU's come
  // over piece by piece through one host buffer as they are written); an
  // asynchronous one takes a copy now, so training can change them while the
  // copy is written (on a GPU, a host copy of everything it saves, as
  // torchtitan's async checkpointing keeps).
  size_t largest_on_gpu = 0;
  auto keep = [&](Tensor t, DType dtype) {
    if (!async_ && dtype == t.dtype()) {
      if (!t.device().is_cpu()) largest_on_gpu = std::max(largest_on_gpu, t.nbytes());
      return t;
    }
    if (!t.device().is_cpu()) {  // the writer reads host bytes: a GPU's tensors come over first
      Tensor host = t.to(Device::cpu(), MemCategory::workspace, "checkpoint.staging");
      return dtype == host.dtype() ? host : host.to(dtype, MemCategory::workspace, "checkpoint.staging");
    }
    return t.to(dtype, MemCategory::workspace, "checkpoint.staging");
  };
  for (const ParamSpec& s : specs) {
    p.model.emplace_back(s.name, keep(spec_view(master_flat, s), model_dtype));
    if (p.model_only) continue;
    if (optimizer.is_momentum(s.name)) {  // Muon's, under torch.optim.Muon's name for it
      p.optimizer.emplace_back(s.name + ".momentum_buffer",
                               keep(adam_m->slice(s.offset, s.numel()).view(s.shape), DType::f32));
      continue;
    }
    p.optimizer.emplace_back(s.name + ".exp_avg",
                             keep(adam_m->slice(s.offset, s.numel()).view(s.shape), DType::f32));
    p.optimizer.emplace_back(s.name + ".exp_avg_sq",
                             keep(adam_v->slice(s.offset, s.numel()).view(s.shape), DType::f32));
  }
  if (largest_on_gpu > 0)
    p.staging = Tensor::empty({static_cast<int64_t>((std::min(kStagingBytes, largest_on_gpu) + 3) / 4)}, DType::i32,
                              MemCategory::workspace, "checkpoint.staging", Device::cpu());
  if (!async_) {
    if (!dry_run()) write(p);
    return;
  }
  held_ = std::make_shared<Pending>(std::move(p));
  if (dry_run()) return;
  writer_ = std::thread([this, pending = held_.get()] {
    Profiler::instance().set_thread_name("checkpoint writer");
    try {
      write(*pending);
    } catch (...) {
      writer_error_ = std::current_exception();
    }
  });
}

void Checkpointer::write(Pending& p) {
  const ScopedPhase phase(SpanCategory::checkpoint, "checkpoint.write");
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  std::error_code ec;
  fs::create_directories(folder_, ec);
  ANVIL_CHECK(!ec, "cannot create checkpoint folder '", folder_, "': ", ec.message());
  const fs::path final_dir = path_of(p.step), tmp_dir = final_dir.string() + ".tmp";
  // A run resumes from its newest step folder or moves the newer ones aside
  // first (plan_resume), so a step folder is never there to be replaced.
  ANVIL_CHECK(!fs::exists(final_dir), "saving checkpoint step ", p.step, ": '", final_dir.string(),
              "' already exists; a checkpoint is never overwritten. Move it aside and run again");
  fs::remove_all(tmp_dir, ec);  // an unfinished save of this step from a run that died
  fs::create_directories(tmp_dir, ec);
  ANVIL_CHECK(!ec, "cannot create '", tmp_dir.string(), "': ", ec.message());

  size_t total = 0;
  for (const auto* group : {&p.model, &p.optimizer})
    for (const auto& [name, t] : *group) total += t.nbytes();
  const int64_t kill_step = kill_during_save_step();
  auto last_report = Clock::now();
  // Long saves report progress every few seconds; a kill hook fires halfway.
  auto progress = [&](size_t now_done, size_t) {
    if (kill_step == p.step && now_done * 2 >= total) std::raise(SIGKILL);
    if (std::chrono::duration<double>(Clock::now() - last_report).count() >= 2.0) {
      last_report = Clock::now();
      const double secs = std::chrono::duration<double>(Clock::now() - t0).count();
      std::printf("anvil: checkpoint step-%lld: %s of %s written (%.0f%%, %.0f MB/s)\n",
                  static_cast<long long>(p.step), human_bytes(now_done).c_str(), human_bytes(total).c_str(),
                  100.0 * static_cast<double>(now_done) / static_cast<double>(total),
                  static_cast<double>(now_done) / secs / 1e6);
      std::fflush(stdout);
    }
  };
  try {
    write_files(p, tmp_dir, progress);
  } catch (const Error& e) {
    fs::remove_all(tmp_dir, ec);  // frees the space; the previous checkpoints stay as they were
    const int64_t previous = latest_step();
    throw Error(detail::concat("saving checkpoint step ", p.step, " failed: ", e.what(), "; ",
                               previous >= 0 ? "the previous checkpoint " + path_of(previous) + " is intact"
                                             : std::string("there is no earlier checkpoint")));
  }
  fs::rename(tmp_dir, final_dir, ec);
  ANVIL_CHECK(!ec, "cannot rename '", tmp_dir.string(), "' to '", final_dir.string(), "': ", ec.message());
  fsync_path(folder_, true);
  drop_oldest();
  size_t bytes = 0;
  for (const auto& e : fs::directory_iterator(final_dir)) bytes += fs::file_size(e.path());
  std::printf("anvil: checkpoint %s saved (%s%s, %.2fs%s)\n", final_dir.c_str(), human_bytes(bytes).c_str(),
              p.model_only ? ", model only" : "", std::chrono::duration<double>(Clock::now() - t0).count(),
              async_ ? ", in the background" : "");
  std::fflush(stdout);
}

void Checkpointer::write_files(const Pending& p, const fs::path& dir,
                               const std::function<void(size_t, size_t)>& progress) const {
  size_t model_bytes = 0;
  for (const auto& [n, t] : p.model) model_bytes += t.nbytes();
  std::vector<std::string> files = {kModelFile};
  save_safetensors((dir / kModelFile).string(), p.model, {}, [&](size_t done, size_t all) { progress(done, all); },
                   p.staging);
  if (!p.model_only) {
    save_safetensors((dir / kOptimizerFile).string(), p.optimizer, {},
                     [&](size_t done, size_t all) { progress(model_bytes + done, all); }, p.staging);
    files.push_back(kOptimizerFile);
  }
  auto write_text = [&](const std::string& name, const std::string& text) {
    std::ofstream out(dir / name);
    out << text;
    out.flush();
    ANVIL_CHECK(out.good(), "writing '", (dir / name).string(), "' failed; is the disk full?");
  };
  write_text(kConfigFile, p.meta.config_toml);
  files.push_back(kConfigFile);

  nlohmann::ordered_json state;
  state["format_version"] = kCheckpointFormatVersion;
  state["step"] = p.step;
  state["model"] = p.meta.model;
  state["model_only"] = p.model_only;
  if (!p.model_only) state["optimizer"] = p.optimizer_name;
  state["model_dtype"] = dtype_name(p.model.front().second.dtype());
  state["loader"] = p.meta.loader;
  state["rng"] = p.meta.rng;
  if (!p.meta.model_state.is_null()) state["model_state"] = p.meta.model_state;
  if (std::isfinite(p.meta.loss)) state["loss"] = p.meta.loss;
  for (const std::string& f : files) {
    fsync_path(dir / f, false);
    state["crc32"][f] = file_crc32(dir / f);
    state["bytes"][f] = fs::file_size(dir / f);
  }
  write_text("state.json", state_json_text(state));
  fsync_path(dir / "state.json", false);
  fsync_path(dir, true);
}

void Checkpointer::drop_oldest() const {
  if (keep_latest_k_ <= 0) return;
  // Only complete steps count and go; a damaged folder is the user's to judge.
  std::vector<StepFolder> complete;
  for (StepFolder& f : scan_checkpoint_folder(folder_))
    if (f.kind != StepFolder::Kind::damaged) complete.push_back(std::move(f));
  for (size_t i = 0; i + static_cast<size_t>(keep_latest_k_) < complete.size(); ++i) fs::remove_all(complete[i].path);
}

nlohmann::json Checkpointer::load(int64_t step, ParamStore& params, Tensor& adam_m, Tensor& adam_v,
                                  const CheckpointOptimizer& optimizer) const {
  const nlohmann::json state = load(step, params.specs(), params.master_flat(), adam_m, adam_v, optimizer);
  params.sync_compute_copy();
  return state;
}

nlohmann::json Checkpointer::load(int64_t step, const std::vector<ParamSpec>& specs, const Tensor& master_flat,
                                  const Tensor& adam_m, const Tensor& adam_v,
                                  const CheckpointOptimizer& optimizer) const {
  const fs::path dir = path_of(step);
  const nlohmann::json state = read_checkpoint_state(dir);
  ANVIL_CHECK(!state.value("model_only", false), "checkpoint '", dir.string(),
              "' holds only the model weights (checkpoint.last_save_model_only); it cannot be resumed from. "
              "Use it as checkpoint.initial_load_path to start a new run from its weights");
  // Checkpoints written before Muon hold AdamW's state and say nothing.
  const std::string saved = state.value("optimizer", std::string("AdamW"));
  ANVIL_CHECK(saved == optimizer.name, "checkpoint '", dir.string(), "' holds the state of optimizer.name = \"", saved,
              "\", and this run sets \"", optimizer.name, "\"; a run cannot change its optimizer on resume. Set ",
              "optimizer.name = \"", saved, "\" to resume it, or start a new run from its weights with ",
              "checkpoint.initial_load_path");
  verify_checkpoint_files(dir, state);
  load_model_file(dir, specs, master_flat);
  const fs::path opt_path = dir / kOptimizerFile;
  const SafetensorsFile state_file = load_safetensors(opt_path.string());
  for (const ParamSpec& s : specs) {
    if (optimizer.is_momentum(s.name)) {
      copy_into(state_file, opt_path, s.name + ".momentum_buffer", adam_m.slice(s.offset, s.numel()).view(s.shape));
      continue;
    }
    copy_into(state_file, opt_path, s.name + ".exp_avg", adam_m.slice(s.offset, s.numel()).view(s.shape));
    copy_into(state_file, opt_path, s.name + ".exp_avg_sq", adam_v.slice(s.offset, s.numel()).view(s.shape));
  }
  return state;
}

void load_checkpoint_model(const std::string& step_dir, ParamStore& params) {
  const nlohmann::json state = read_checkpoint_state(step_dir);
  verify_checkpoint_files(step_dir, state);
  load_model_file(step_dir, params.specs(), params.master_flat());
  params.sync_compute_copy();
}

CheckpointWeights load_checkpoint_weights(const std::string& step_dir) {
  const fs::path dir(step_dir);
  CheckpointWeights out;
  out.state = read_checkpoint_state(dir);
  verify_checkpoint_files(dir, out.state);
  out.tensors = load_safetensors((dir / kModelFile).string(), MemCategory::parameters).tensors;
  for (auto& [name, t] : out.tensors) {
    ANVIL_CHECK(t.dtype() == DType::f32 || t.dtype() == DType::bf16, "'", (dir / kModelFile).string(),
                "': tensor '", name, "' is ", dtype_name(t.dtype()), "; checkpoints hold f32 or bf16 weights");
    if (t.dtype() == DType::bf16) t = t.to(DType::f32, MemCategory::parameters, name);  // exact
  }
  return out;
}

std::string checkpoint_model(const nlohmann::json& state) {
  // "model" since the format gained config.toml; "config" held it before.
  for (const char* key : {"model", "config"}) {
    const auto it = state.find(key);
    if (it != state.end() && it->is_string()) return it->get<std::string>();
  }
  return "";
}

size_t save_model_only_checkpoint(const std::string& folder, int64_t step,
                                  const std::vector<std::pair<std::string, Tensor>>& weights,
                                  const std::string& model, const nlohmann::json& extra) {
  std::error_code ec;
  fs::create_directories(folder, ec);
  ANVIL_CHECK(!ec, "cannot create checkpoint folder '", folder, "': ", ec.message());
  const fs::path final_dir = fs::path(folder) / ("step-" + std::to_string(step)), tmp_dir = final_dir.string() + ".tmp";
  ANVIL_CHECK(!fs::exists(final_dir), "'", final_dir.string(), "' already exists; remove it or choose another folder");
  fs::remove_all(tmp_dir, ec);
  fs::create_directories(tmp_dir, ec);
  ANVIL_CHECK(!ec, "cannot create '", tmp_dir.string(), "': ", ec.message());
  save_safetensors((tmp_dir / kModelFile).string(), weights);
  fsync_path(tmp_dir / kModelFile, false);

  nlohmann::ordered_json state;
  state["format_version"] = kCheckpointFormatVersion;
  state["step"] = step;
  state["model"] = model;
  state["model_only"] = true;
  state["model_dtype"] = dtype_name(weights.front().second.dtype());
  for (const auto& [k, v] : extra.items()) state[k] = v;
  state["crc32"][kModelFile] = file_crc32(tmp_dir / kModelFile);
  state["bytes"][kModelFile] = fs::file_size(tmp_dir / kModelFile);
  write_file_durably(tmp_dir / "state.json", state_json_text(state));
  fsync_path(tmp_dir, true);
  fs::rename(tmp_dir, final_dir, ec);
  ANVIL_CHECK(!ec, "cannot rename '", tmp_dir.string(), "' to '", final_dir.string(), "': ", ec.message());
  fsync_path(folder, true);
  return fs::file_size(final_dir / kModelFile);
}

}  // namespace anvil
