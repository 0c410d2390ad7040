// Runs of the anvil binary that many test cases need alike (the single-process
// references of tests/layout_parity.h), kept on disk so that each is made once
// per ctest run rather than once per case: ctest runs every case in a process
// of its own, so a cache in memory lives for one case only. Over the layout
// rows this saves about 120 reference runs of 2 to 4 s each.
//
// An entry is keyed by the text of everything the run depends on: its
// arguments (with the scratch folder's path, which differs between processes,
// taken out) and the contents of its input files; the anvil binary's size and
// modification time key the whole cache, whose entries are removed when they
// change. The folder (ANVIL_RUN_CACHE, in the build tree) is removed at the
// end of every ctest run by the RunCache.Removed fixture (tests/CMakeLists.txt):
// a reference takes about 140 MB with its checkpoints. (A scratch folder kept
// with ANVIL_KEEP_TEST_FILES then links to removed entries: run the case's
// test program directly, outside ctest, to keep its reference.)
//
// Entries are only read. A run is made in the case's own folder, then moved
// into the cache under a name of its own and renamed to its entry's (atomic,
// so a concurrent case sees a whole entry or none), with a link left behind.
#pragma once
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace anvil::testing {

class RunCache {
 public:
  RunCache() : root_(ANVIL_RUN_CACHE) {
    namespace fs = std::filesystem;
    const std::string binary = std::to_string(fs::file_size(ANVIL_BINARY)) + " " +
                               std::to_string(fs::last_write_time(ANVIL_BINARY).time_since_epoch().count());
    std::string cached;
    std::getline(std::ifstream(root_ / "binary"), cached);
    if (cached == binary) return;
    std::error_code ec;
    fs::remove_all(root_, ec);
    fs::create_directories(root_);
    std::ofstream(root_ / "binary") << binary << "\n";
  }

  // The entry for `key`, or an empty path when there is none.
  std::filesystem::path find(const std::string& key) const {
    const std::filesystem::path entry = root_ / digest(key);
    std::ifstream in(entry / kKeyFile);
    std::stringstream stored;
    stored << in.rdbuf();
    return in && stored.str() == key ? entry : std::filesystem::path();
  }

  // Moves the finished run in `folder` into the entry for `key` and links
  // `folder` to it; where another process made the entry first, links to that.
  void keep(const std::filesystem::path& folder, const std::string& key) const {
    namespace fs = std::filesystem;
    const fs::path entry = root_ / digest(key);
    const fs::path mine = root_ / (digest(key) + ".tmp-" + std::to_string(::getpid()));
    std::ofstream(folder / kKeyFile) << key;
    std::error_code ec;
    fs::rename(folder, mine, ec);
    if (ec) return;  // another filesystem: the run stays where it is, uncached
    fs::rename(mine, entry, ec);
    if (ec) fs::remove_all(mine);  // the entry exists: the same run, made by another case
    fs::create_directory_symlink(entry, folder);
  }

 private:
  // FNV-1a, 64 bits, in hex: stable across builds and compilers.
  static std::string digest(const std::string& text) {
    uint64_t h = 14695981039346656037ull;
    for (const unsigned char c : text) h = (h ^ c) * 1099511628211ull;
    char out[17];
    std::snprintf(out, sizeof out, "%016llx", static_cast<unsigned long long>(h));
    return out;
  }

  static constexpr const char* kKeyFile = "run_cache_key.txt";  // the entry's key, checked by find
  std::filesystem::path root_;
};

}  // namespace anvil::testing
