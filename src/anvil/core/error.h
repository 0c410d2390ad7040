// One error type for everything a user can cause. Messages say what was wrong,
// where, and what to do; programmer errors use ANVIL_ASSERT and abort loudly.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace anvil {

class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
template <class... Args>
std::string concat(const Args&... args) {
  std::ostringstream out;
  (out << ... << args);
  return out.str();
}
[[noreturn]] void assert_fail(const char* expr, const char* file, int line, const std::string& msg);
}  // namespace detail

}  // namespace anvil

// Throws anvil::Error with a message built from the remaining arguments.
#define ANVIL_CHECK(cond, ...)                                           \
  do {                                                                   \
    if (!(cond)) throw ::anvil::Error(::anvil::detail::concat(__VA_ARGS__)); \
  } while (0)

// An internal invariant: a failure is a bug in Anvil, not in the user's input.
#define ANVIL_ASSERT(cond, ...)                                                              \
  do {                                                                                       \
    if (!(cond))                                                                             \
      ::anvil::detail::assert_fail(#cond, __FILE__, __LINE__,                                \
                                   ::anvil::detail::concat("" __VA_OPT__(, ) __VA_ARGS__)); \
  } while (0)
