// A checkpoint folder as a resuming run sees it: which step-<N> folders are
// complete, which are damaged and why, and which step a run resumes from.
// Nothing here is ever deleted or overwritten silently: a damaged newest step
// stops the run, and stepping back past newer folders needs the user's word
// (checkpoint.overwrite_newer), which moves them aside under another name.
#pragma once
#include <cstdint>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace anvil {

// state.json: its text carries a CRC32 of its own content on its first line
// (`"state_crc32": N`, over every other byte), so a flipped digit that still
// parses is caught. Format 1 (before the self-checksum and the file sizes) is
// still read.
constexpr int kCheckpointFormatVersion = 2;
std::string state_json_text(nlohmann::ordered_json state);  // adds the self-checksum
// Reads and checks `dir`/state.json: present, parses, self-checksum, format.
// Throws anvil::Error naming the file and what is wrong.
nlohmann::json read_checkpoint_state(const std::filesystem::path& dir);
// Every file state.json lists is present with the size it recorded (cheap: no
// byte is read). Throws anvil::Error naming the file.
void check_checkpoint_files_present(const std::filesystem::path& dir, const nlohmann::json& state);
// The same and every file's CRC32 (reads every byte).
void verify_checkpoint_files(const std::filesystem::path& dir, const nlohmann::json& state);
uint32_t file_crc32(const std::filesystem::path& path);

// One step-<N> folder, judged by state.json and the files' presence and sizes.
struct StepFolder {
  enum class Kind { resumable, model_only, damaged };
  int64_t step = 0;
  std::filesystem::path path;
  Kind kind = Kind::damaged;
  std::string problem;  // what is wrong, when damaged
  std::string model;    // "<name>/<flavor>" state.json recorded ("" when damaged or unrecorded)
};
// Every step-<N> folder in `folder` (never step-<N>.tmp, an unfinished save, or
// a folder set aside), by step.
std::vector<StepFolder> scan_checkpoint_folder(const std::filesystem::path& folder);

// Where a run starts: `step` (-1: afresh) and the newer step folders that
// must be moved aside first (only when checkpoint.overwrite_newer asked for it).
struct ResumePlan {
  int64_t step = -1;
  std::string model;                      // what the resumed step holds
  std::vector<StepFolder> set_aside;      // newer folders, moved aside after the load succeeds
};
// load_step -1: the newest step folder, which must be resumable. load_step N:
// step-N, which must be resumable. Either way a newer step folder (damaged,
// model-only, or complete) is refused unless overwrite_newer. Throws
// anvil::Error saying what is wrong, which complete steps exist and the keys
// that resume from one.
ResumePlan plan_resume(const std::filesystem::path& folder, int64_t load_step, bool overwrite_newer);
// Renames each folder to step-<N>.damaged-<time> (damaged) or
// step-<N>.superseded-<time> (complete), printing one line each.
void set_aside(const std::vector<StepFolder>& folders);
// What to do when step `failed` cannot be loaded: the complete steps before it
// and the keys that resume from one, or how to start afresh.
std::string resume_remedy(const std::filesystem::path& folder, int64_t failed);

}  // namespace anvil
