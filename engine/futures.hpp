/// \file
/// Waiting for work that runs beside the caller (one thread per replica): every result, each
/// within a deadline, and the most telling error.
#pragma once

#include <chrono>
#include <exception>
#include <functional>
#include <future>
#include <vector>

#include <actorpipe/errors.hpp>

namespace actorpipe::detail {

// How much an error says of what went wrong: a lost node names the node, where the other
// replicas' failed all-reduce or timeout only follows from it.
inline int telling(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const pipeline_error& e) {
    return e.kind() == error_kind::node_lost ? 2 : 1;
  } catch (...) {
    return 1;
  }
}

// Every future's value, in order; each waited for at most `deadline`. All are waited for before
// an error is rethrown (a lost node's before the others'), so no replica is left running
// unobserved. `outcomes`, when given, receives each future's error (null: it succeeded), and
// `on_value(r, value)` sees each value that came.
template <class T>
std::vector<T> get_all(std::vector<std::future<T>>& futures, std::chrono::milliseconds deadline,
                       const char* what, std::vector<std::exception_ptr>* outcomes = nullptr,
                       const std::function<void(std::size_t, const T&)>& on_value = {}) {
  std::exception_ptr error;
  std::vector<T> values;
  if (outcomes != nullptr) {
    outcomes->assign(futures.size(), nullptr);
  }
  for (std::size_t r = 0; r < futures.size(); ++r) {
    try {
      if (futures[r].wait_for(deadline) != std::future_status::ready) {
        throw pipeline_error(
          detail::concat(what, ": replica ", r, " did not answer within ", deadline.count(), " ms"),
          error_details{error_kind::timeout});
      }
      values.push_back(futures[r].get());
      if (on_value) {
        on_value(r, values.back());
      }
    } catch (...) {
      if (outcomes != nullptr) {
        (*outcomes)[r] = std::current_exception();
      }
      if (!error || telling(std::current_exception()) > telling(error)) {
        error = std::current_exception();
      }
    }
  }
  if (error) {
    std::rethrow_exception(error);
  }
  return values;
}

} // namespace actorpipe::detail
