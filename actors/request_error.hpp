/// \file
/// Words for a failed request between actors: a timeout says how long was waited, anything else
/// is CAF's rendering of the error.
#pragma once

#include <chrono>
#include <optional>
#include <string>

#include <caf/actor_system.hpp>
#include <caf/error.hpp>
#include <caf/message.hpp>
#include <caf/sec.hpp>

#include <actorpipe/errors.hpp>

#include "actors/pipeline_errc.hpp"

namespace actorpipe::actors {

/// "did not answer within 5000 ms" for a request that timed out, else "failed: <CAF's error>".
inline std::string request_error(caf::actor_system& sys, const caf::error& err,
                                 std::chrono::milliseconds timeout) {
  if (err == caf::sec::request_timeout) {
    return detail::concat("did not answer within ", timeout.count(), " ms");
  }
  return "failed: " + sys.render(err);
}

/// The sentence an error carries: a refusal's (actors/pipeline_errc.hpp), which stages, their
/// proxies and nodes answer with, whose context starts with it.
inline std::optional<std::string> carried_sentence(const caf::error& err) {
  const auto& context = err.context();
  if (is_pipeline_error(err) && context.size() >= 1 && context.match_element<std::string>(0)) {
    return context.get_as<std::string>(0);
  }
  return std::nullopt;
}

/// What kind of failure a failed request is: the kind a refusal carries (actors/pipeline_errc.hpp),
/// or CAF's own: a request that timed out, a receiver that is gone (the stage actor terminated),
/// or something else.
inline error_kind request_error_kind(const caf::error& err) {
  if (is_pipeline_error(err)) {
    return kind_of_pipeline_error(err);
  }
  if (err == caf::sec::request_timeout) {
    return error_kind::timeout;
  }
  if (err == caf::sec::request_receiver_down) {
    return error_kind::stage_lost;
  }
  return error_kind::other;
}

} // namespace actorpipe::actors
