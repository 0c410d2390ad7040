// Whole files: read in one piece, and written to survive a crash (data
// reaches the disk before a rename makes it visible under its final name, so a
// reader finds either the old file or the complete new one, never a torn one).
#pragma once
#include <filesystem>
#include <string>

namespace anvil {

// fsync of a file, or of a folder (its list of entries, after creating or
// renaming something inside it). Throws anvil::Error naming the path.
void fsync_path(const std::filesystem::path& path, bool directory);

// The file's bytes. Throws anvil::Error naming the path when it cannot be read.
std::string read_file(const std::filesystem::path& path);

// Writes `content` to path + ".tmp", fsyncs it and renames it to path.
void write_file_durably(const std::filesystem::path& path, const std::string& content);

}  // namespace anvil
