#include "anvil/core/durable_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "anvil/core/error.h"

namespace anvil {

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  ANVIL_CHECK(in.good(), "cannot read '", path.string(), "'; check that it exists and is readable");
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void fsync_path(const std::filesystem::path& p, bool directory) {
  const int fd = ::open(p.c_str(), directory ? O_RDONLY | O_DIRECTORY : O_RDONLY);
  ANVIL_CHECK(fd >= 0, "cannot open '", p.string(), "' to sync it: ", std::strerror(errno));
  const int rc = ::fsync(fd);
  ::close(fd);
  ANVIL_CHECK(rc == 0, "fsync of '", p.string(), "' failed: ", std::strerror(errno), "; is the disk full?");
}

void write_file_durably(const std::filesystem::path& path, const std::string& content) {
  const std::filesystem::path tmp = path.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    ANVIL_CHECK(out.good(), "cannot write '", tmp.string(), "': ", std::strerror(errno));
    out.write(content.data(), static_cast<std::streamsize>(content.size()));
    out.flush();
    ANVIL_CHECK(out.good(), "writing '", tmp.string(), "' failed; is the disk full?");
  }
  fsync_path(tmp, false);
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  ANVIL_CHECK(!ec, "cannot rename '", tmp.string(), "' to '", path.string(), "': ", ec.message());
}

}  // namespace anvil
