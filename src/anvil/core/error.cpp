#include "anvil/core/error.h"

#include <cstdio>
#include <cstdlib>

namespace anvil::detail {

void assert_fail(const char* expr, const char* file, int line, const std::string& msg) {
  std::fprintf(stderr, "anvil: internal error at %s:%d: assertion `%s` failed%s%s\n", file, line, expr,
               msg.empty() ? "" : ": ", msg.c_str());
  std::fprintf(stderr, "anvil: this is a bug in Anvil; please report it with the command you ran.\n");
  std::abort();
}

}  // namespace anvil::detail
