// The program's version (project() in CMakeLists.txt) and the git commit it
// was built from, "-dirty" when the tracked files differed from it, or
// "unknown" outside a git checkout. Defined in a file the build writes
// (cmake/version.cmake), linked into the `anvil` program only.
#pragma once

namespace anvil {

const char* version();
const char* git_commit();

}  // namespace anvil
