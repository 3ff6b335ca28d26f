/// \file
/// A stage's refusal as CAF error data: what a reply of the stage protocol carries when the
/// request failed (an optimizer step, a save, a load, a state fetch, a block's end), through
/// CAF's error channel rather than as a string in the value; a proxy and a node answer for a
/// stage in the same terms. The code is the error_kind, the category `actorpipe`, the context the
/// sentence that says what failed and where ("stage 1, step 4: optimizer step failed: ...") and
/// the failure's fields (error_details). It crosses to and from nodes as any CAF error does.
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

/// A failure as a CAF error. Its code is the kind plus one (CAF takes code 0 for "no error",
/// which error_kind::other would otherwise be); its context the sentence, then the stage (-1:
/// none), the micro-batch (-1: none), the step (0: none) and the node ("": none).
inline caf::error make_pipeline_error(const error_details& details, std::string sentence) {
  return caf::error(
    static_cast<uint8_t>(static_cast<uint8_t>(details.kind) + 1), pipeline_errors,
    caf::make_message(std::move(sentence),
                      details.stage ? static_cast<int64_t>(*details.stage) : int64_t{-1},
                      details.microbatch.value_or(-1), details.step.value_or(0), details.node));
}
inline caf::error make_pipeline_error(error_kind kind, std::string sentence) {
  return make_pipeline_error(error_details{kind}, std::move(sentence));
}

/// A stage's refusal: `kind`, the stage, the node hosting it ("": in process), `sentence`.
inline caf::error make_stage_refusal(error_kind kind, std::size_t stage, std::string node,
                                     std::string sentence) {
  return make_pipeline_error(
    error_details{kind, stage, std::nullopt, std::nullopt, std::move(node)}, std::move(sentence));
}

/// The reply of a request whose work says only why it refused: `true`, unless `refused`.
inline caf::result<bool> done_unless(caf::error refused) {
  if (refused) {
    return refused;
  }
  return true;
}

inline bool is_pipeline_error(const caf::error& e) {
  return e && e.category() == pipeline_errors;
}

/// The kind a pipeline error carries (error_kind::other for a code this build does not know).
inline error_kind kind_of_pipeline_error(const caf::error& e) {
  return e.code() >= 1 ? error_kind_from_number(e.code() - 1u).value_or(error_kind::other)
                       : error_kind::other;
}

/// The fields a pipeline error carries (make_pipeline_error); only the kind for one that carries
/// none.
inline error_details details_of_pipeline_error(const caf::error& e) {
  error_details d{kind_of_pipeline_error(e)};
  const auto& c = e.context();
  if (c.match_elements<std::string, int64_t, int32_t, uint64_t, std::string>()) {
    if (auto stage = c.get_as<int64_t>(1); stage >= 0) {
      d.stage = static_cast<std::size_t>(stage);
    }
    if (auto microbatch = c.get_as<int32_t>(2); microbatch >= 0) {
      d.microbatch = microbatch;
    }
    if (auto step = c.get_as<uint64_t>(3); step != 0) {
      d.step = step;
    }
    d.node = c.get_as<std::string>(4);
  }
  return d;
}

/// Registers the category with an actor system's configuration: CAF renders such an error as
/// its sentence (actor_system::render).
inline void add_pipeline_errors(caf::actor_system_config& cfg) {
  cfg.add_error_category(pipeline_errors,
                         [](uint8_t code, caf::atom_value, const caf::message& context) {
                           if (context.size() >= 1 && context.match_element<std::string>(0)) {
                             return context.get_as<std::string>(0);
                           }
                           return detail::concat("actorpipe error ", static_cast<int>(code) - 1);
                         });
}

} // namespace actorpipe::actors
