// MSDA_CHECK(cond, parts...): throws std::runtime_error (RuntimeError in
// Python) whose message is the parts streamed together, nothing added. No
// torch here: the planners use it too.
#pragma once

#include <sstream>
#include <stdexcept>

namespace msda::detail {
template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  std::ostringstream os;
  ((os << args), ...);
  throw std::runtime_error(os.str());
}
}  // namespace msda::detail

#define MSDA_CHECK(cond, ...)                       \
  do {                                              \
    if (!(cond)) ::msda::detail::fail(__VA_ARGS__); \
  } while (0)
