/// \file
/// A stage's refusal as CAF error data: what a reply of the stage protocol carries when the
/// request failed (an optimizer step, a save, a load, a state fetch, a block's end), through
/// CAF's error channel rather than as a string in the value. The code is the error_kind, the
/// category `actorpipe`, the context one string: the sentence that says what failed and where
/// ("stage 1, step 4: optimizer step failed: ..."). It crosses to and from nodes as any CAF
/// error does.
#pragma once

#include <string>

#include <caf/actor_system_config.hpp>
#include <caf/atom.hpp>
#include <caf/error.hpp>
#include <caf/make_message.hpp>
#include <caf/message.hpp>
#include <caf/result.hpp>

#include <actorpipe/errors.hpp>

namespace actorpipe::actors {

/// The category of actorpipe's errors in CAF.
constexpr caf::atom_value pipeline_errors = caf::atom("actorpipe");

/// `kind` and the sentence as a CAF error. Its code is the kind plus one: CAF takes code 0 for
/// "no error", which error_kind::other would otherwise be.
inline caf::error make_pipeline_error(error_kind kind, std::string sentence) {
  return caf::error(static_cast<uint8_t>(static_cast<uint8_t>(kind) + 1), pipeline_errors,
                    caf::make_message(std::move(sentence)));
}

/// A reply that is done (true) unless `error` says what failed: then the refusal of `kind`.
inline caf::result<bool> done_or_refused(error_kind kind, std::string error) {
  if (error.empty()) {
    return true;
  }
  return make_pipeline_error(kind, std::move(error));
}

inline bool is_pipeline_error(const caf::error& e) {
  return e && e.category() == pipeline_errors;
}

/// The kind a pipeline error carries (error_kind::other for a code this build does not know).
inline error_kind kind_of_pipeline_error(const caf::error& e) {
  return e.code() >= 1 && e.code() <= static_cast<uint8_t>(error_kind::out_of_memory) + 1
           ? static_cast<error_kind>(e.code() - 1)
           : error_kind::other;
}

/// Registers the category with an actor system's configuration: CAF renders such an error as
/// its sentence (actor_system::render).
inline void add_pipeline_errors(caf::actor_system_config& cfg) {
  cfg.add_error_category(pipeline_errors,
                         [](uint8_t code, caf::atom_value, const caf::message& context) {
                           if (context.size() == 1 && context.match_element<std::string>(0)) {
                             return context.get_as<std::string>(0);
                           }
                           return detail::concat("actorpipe error ", static_cast<int>(code) - 1);
                         });
}

} // namespace actorpipe::actors
