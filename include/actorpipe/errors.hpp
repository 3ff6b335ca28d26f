/// \file
/// Errors thrown by actorpipe at its API edges, and the checking macros that throw them.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace actorpipe {

/// Thrown when a caller passes something that cannot work (bad option, unknown name, cut out of
/// range). Nothing has been changed when it is thrown.
class invalid_argument : public std::invalid_argument {
public:
  using std::invalid_argument::invalid_argument;
};

/// Thrown (or carried by a failed step) when a pipeline step fails at run time: a stage could
/// not take its input, a wait ran past its deadline, a stage died. The message names the stage,
/// the micro-batch and the action. A failed step leaves parameters and buffers as they were.
class pipeline_error : public std::runtime_error {
public:
  using std::runtime_error::runtime_error;
};

namespace detail {

template <class... Ts>
std::string concat(Ts&&... xs) {
  std::ostringstream out;
  (out << ... << std::forward<Ts>(xs));
  return out.str();
}

[[noreturn]] void assertion_failed(const char* condition, const char* file, int line);

} // namespace detail
} // namespace actorpipe

/// Throws actorpipe::invalid_argument with the concatenated message unless `cond` holds.
#define ACTORPIPE_CHECK(cond, ...)                                                                 \
  do {                                                                                             \
    if (!(cond)) {                                                                                 \
      throw ::actorpipe::invalid_argument(::actorpipe::detail::concat(__VA_ARGS__));               \
    }                                                                                              \
  } while (false)

/// Aborts with file and line unless `cond` holds; always on: a failure is a bug in actorpipe.
#define ACTORPIPE_ASSERT(cond)                                                                     \
  do {                                                                                             \
    if (!(cond)) {                                                                                 \
      ::actorpipe::detail::assertion_failed(#cond, __FILE__, __LINE__);                            \
    }                                                                                              \
  } while (false)
