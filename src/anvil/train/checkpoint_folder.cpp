#include "anvil/train/checkpoint_folder.h"

#include <zlib.h>

#include <algorithm>
#include <cstdio>
#include <ctime>
#include <fstream>

#include "anvil/core/durable_file.h"
#include "anvil/core/error.h"

namespace anvil {

namespace fs = std::filesystem;

namespace {

constexpr const char* kStateFile = "state.json";
// The self-checksum's line: the first member of state.json, on a line of its own.
constexpr const char* kCrcLinePrefix = "{\n  \"state_crc32\": ";

uint32_t crc32_of(const std::string& bytes) {
  uLong crc = crc32(0L, Z_NULL, 0);
  return static_cast<uint32_t>(
      crc32(crc, reinterpret_cast<const Bytef*>(bytes.data()), static_cast<uInt>(bytes.size())));
}

bool parse_step_dir(const std::string& name, int64_t& step) {
  if (name.rfind("step-", 0) != 0 || name.size() <= 5 || name.size() > 5 + 18) return false;
  const std::string digits = name.substr(5);
  if (!std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; })) return false;
  step = std::stoll(digits);
  return true;
}

std::string kind_name(const StepFolder& f) {
  switch (f.kind) {
    case StepFolder::Kind::resumable: return "complete";
    case StepFolder::Kind::model_only: return "model weights only";
    case StepFolder::Kind::damaged: return "damaged";
  }
  return "";
}

// "step-2, step-4 (complete), step-6 (model weights only)": every folder, by kind.
std::string describe(const std::vector<StepFolder>& folders) {
  std::string out;
  for (size_t i = 0; i < folders.size(); ++i) {
    const bool last_of_kind = i + 1 == folders.size() || folders[i + 1].kind != folders[i].kind;
    out += (out.empty() ? "" : ", ") + folders[i].path.filename().string();
    if (last_of_kind) out += " (" + kind_name(folders[i]) + ")";
  }
  return out.empty() ? "none" : out;
}

const StepFolder* newest_resumable_before(const std::vector<StepFolder>& folders, int64_t step) {
  const StepFolder* best = nullptr;
  for (const StepFolder& f : folders)
    if (f.step < step && f.kind == StepFolder::Kind::resumable) best = &f;
  return best;
}

std::string local_time_stamp() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  localtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y%m%d-%H%M%S", &tm);
  return buf;
}

}  // namespace

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

std::string state_json_text(nlohmann::ordered_json state) {
  state.erase("state_crc32");
  const std::string body = state.dump(2) + "\n";  // "{\n  ...\n}\n"
  ANVIL_ASSERT(body.rfind("{\n", 0) == 0, "state.json is an object");
  return kCrcLinePrefix + std::to_string(crc32_of(body)) + ",\n" + body.substr(2);
}

nlohmann::json read_checkpoint_state(const fs::path& dir) {
  const fs::path path = dir / kStateFile;
  std::error_code ec;
  ANVIL_CHECK(fs::exists(path, ec), "'", path.string(), "' is missing, so '", dir.string(),
              "' is not a complete checkpoint");
  const std::string text = read_file(path);
  nlohmann::json state = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  ANVIL_CHECK(!state.is_discarded() && state.is_object(), "'", path.string(), "' is not valid JSON (",
              text.size(), " bytes; truncated or overwritten)");
  const int version = state.value("format_version", 0);
  ANVIL_CHECK(version == 1 || version == kCheckpointFormatVersion, "'", path.string(), "' has format version ",
              version, "; this build reads versions 1 and ", kCheckpointFormatVersion);
  if (version >= 2) {
    // The first line holds the checksum of everything else, byte for byte.
    const size_t prefix = std::string(kCrcLinePrefix).size();
    const size_t eol = text.find('\n', prefix);
    ANVIL_CHECK(text.rfind(kCrcLinePrefix, 0) == 0 && eol != std::string::npos && state.contains("state_crc32") &&
                    state["state_crc32"].is_number_unsigned(),
                "'", path.string(), "' has lost its checksum line (\"state_crc32\"); it was altered after it was written");
    const uint32_t want = state["state_crc32"].get<uint32_t>();
    const uint32_t got = crc32_of("{\n" + text.substr(eol + 1));
    ANVIL_CHECK(got == want, "'", path.string(), "' is corrupt: its content has CRC32 ", got,
                " but its state_crc32 line says ", want);
  }
  ANVIL_CHECK(state.contains("crc32") && state["crc32"].is_object() && state.contains("step"), "'", path.string(),
              "' lacks the \"crc32\" or \"step\" field of a checkpoint's state");
  return state;
}

void check_checkpoint_files_present(const fs::path& dir, const nlohmann::json& state) {
  const nlohmann::json sizes = state.value("bytes", nlohmann::json::object());
  for (const auto& [f, crc] : state.at("crc32").items()) {
    std::error_code ec;
    const fs::path p = dir / f;
    ANVIL_CHECK(fs::is_regular_file(p, ec), "checkpoint file '", p.string(), "' is missing");
    const auto size = fs::file_size(p, ec);
    if (sizes.contains(f))
      ANVIL_CHECK(!ec && size == sizes[f].get<uintmax_t>(), "checkpoint file '", p.string(), "' is ", size,
                  " bytes but state.json recorded ", sizes[f].get<uintmax_t>(),
                  size < sizes[f].get<uintmax_t>() ? " (truncated)" : "");
  }
}

void verify_checkpoint_files(const fs::path& dir, const nlohmann::json& state) {
  check_checkpoint_files_present(dir, state);
  for (const auto& [f, crc] : state.at("crc32").items()) {
    const uint32_t want = crc.get<uint32_t>(), got = file_crc32(dir / f);
    ANVIL_CHECK(got == want, "checkpoint file '", (dir / f).string(), "' is corrupt: CRC32 ", got,
                " but state.json recorded ", want);
  }
}

std::vector<StepFolder> scan_checkpoint_folder(const fs::path& folder) {
  std::vector<StepFolder> out;
  std::error_code ec;
  if (!fs::is_directory(folder, ec)) return out;
  for (const auto& e : fs::directory_iterator(folder, ec)) {
    StepFolder f;
    if (!e.is_directory() || !parse_step_dir(e.path().filename().string(), f.step)) continue;
    f.path = e.path();
    try {
      const nlohmann::json state = read_checkpoint_state(f.path);
      check_checkpoint_files_present(f.path, state);
      f.kind = state.value("model_only", false) ? StepFolder::Kind::model_only : StepFolder::Kind::resumable;
      if (state.contains("model") && state["model"].is_string()) f.model = state["model"].get<std::string>();
    } catch (const Error& err) {
      f.kind = StepFolder::Kind::damaged;
      f.problem = err.what();
    }
    out.push_back(std::move(f));
  }
  std::sort(out.begin(), out.end(), [](const StepFolder& a, const StepFolder& b) { return a.step < b.step; });
  return out;
}

std::string resume_remedy(const fs::path& folder, int64_t failed) {
  const std::vector<StepFolder> folders = scan_checkpoint_folder(folder);
  std::string newer;
  for (const StepFolder& f : folders)
    if (f.step >= failed) newer += (newer.empty() ? "" : ", ") + f.path.filename().string();
  const std::string found = "Step folders in " + folder.string() + ": " + describe(folders) + ". ";
  const std::string moved =
      " moves " + newer + " aside (renamed step-<N>.damaged-<time> or .superseded-<time>; nothing is deleted)";
  if (const StepFolder* back = newest_resumable_before(folders, failed))
    return found + "To resume from " + back->path.filename().string() +
           ", the newest complete step before it, run again with --checkpoint.load_step " +
           std::to_string(back->step) + " --checkpoint.overwrite_newer true, which" + moved +
           "; or move the damaged folder out of " + folder.string() + " yourself";
  return found + "No complete step precedes it. To start afresh, run again with --checkpoint.overwrite_newer true, "
                 "which" + moved + "; or give another --job.dump_folder";
}

ResumePlan plan_resume(const fs::path& folder, int64_t load_step, bool overwrite_newer) {
  const std::vector<StepFolder> folders = scan_checkpoint_folder(folder);
  ResumePlan plan;
  const StepFolder* from = nullptr;
  if (load_step >= 0) {
    for (const StepFolder& f : folders)
      if (f.step == load_step) from = &f;
    ANVIL_CHECK(from != nullptr, "checkpoint.load_step ", load_step, ": there is no ",
                (folder / ("step-" + std::to_string(load_step))).string(), ". Step folders in ", folder.string(), ": ",
                describe(folders), ". Name one of the complete ones, or -1 for the newest");
    ANVIL_CHECK(from->kind != StepFolder::Kind::damaged, "checkpoint.load_step ", load_step, ": ",
                from->path.string(), " is damaged: ", from->problem, ". ", resume_remedy(folder, load_step));
    ANVIL_CHECK(from->kind != StepFolder::Kind::model_only, "checkpoint ", from->path.string(),
                " holds only the model weights (checkpoint.last_save_model_only); it cannot be resumed from. "
                "Use it as checkpoint.initial_load_path to start a new run from its weights");
  } else if (!folders.empty()) {
    const StepFolder& newest = folders.back();
    if (newest.kind == StepFolder::Kind::resumable) {
      from = &newest;
    } else if (!overwrite_newer) {
      if (newest.kind == StepFolder::Kind::damaged)
        throw Error(detail::concat("checkpoint ", newest.path.string(), " is damaged: ", newest.problem,
                                   ". It is the newest step in ", folder.string(),
                                   ", so the run stopped before loading or writing anything. ",
                                   resume_remedy(folder, newest.step)));
      const StepFolder* back = newest_resumable_before(folders, newest.step);
      throw Error(detail::concat(
          "the newest step in ", folder.string(), ", ", newest.path.string(),
          ", holds only the model weights (checkpoint.last_save_model_only), so training cannot continue from it. ",
          back ? detail::concat("To continue from ", back->path.filename().string(),
                                " and retrain the steps after it, run again with --checkpoint.load_step ", back->step,
                                " --checkpoint.overwrite_newer true (moves the newer folders aside; nothing is "
                                "deleted). ")
               : std::string(),
          "To start a new run from its weights, give --checkpoint.initial_load_path ", newest.path.string(),
          " and another --job.dump_folder"));
    } else {
      from = newest_resumable_before(folders, newest.step + 1);  // may be none: start afresh
    }
  }
  const int64_t from_step = from ? from->step : -1;
  for (const StepFolder& f : folders)
    if (f.step > from_step) plan.set_aside.push_back(f);
  if (!plan.set_aside.empty() && !overwrite_newer)
    throw Error(detail::concat(
        "checkpoint.load_step ", load_step, ": ", folder.string(), " holds newer step folders (",
        describe(plan.set_aside), "); resuming from step ", load_step,
        " would retrain those steps and write over them. Run again with --checkpoint.overwrite_newer true to move "
        "them aside first (renamed step-<N>.damaged-<time> or .superseded-<time>; nothing is deleted), or move them "
        "out of the folder yourself"));
  if (from) {
    plan.step = from->step;
    plan.model = from->model;
  }
  return plan;
}

void set_aside(const std::vector<StepFolder>& folders) {
  const std::string stamp = local_time_stamp();
  for (const StepFolder& f : folders) {
    const std::string suffix = f.kind == StepFolder::Kind::damaged ? ".damaged-" : ".superseded-";
    fs::path to = f.path.string() + suffix + stamp;
    for (int i = 2; fs::exists(to); ++i) to = f.path.string() + suffix + stamp + "-" + std::to_string(i);
    std::error_code ec;
    fs::rename(f.path, to, ec);
    ANVIL_CHECK(!ec, "cannot move '", f.path.string(), "' aside to '", to.string(), "': ", ec.message());
    fsync_path(f.path.parent_path(), true);
    std::printf("anvil: moved %s aside to %s (checkpoint.overwrite_newer)%s\n", f.path.string().c_str(),
                to.filename().c_str(), f.kind == StepFolder::Kind::damaged ? "; it was damaged" : "");
  }
  std::fflush(stdout);
}

}  // namespace anvil
