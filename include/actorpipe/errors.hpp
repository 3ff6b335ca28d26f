/// \file
/// Vocabulary: errors thrown by actorpipe at its API edges and by failed steps, with what failed
/// as fields an application can act on, and the checking macros that throw them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace actorpipe {
namespace detail {

/// `text` as valid UTF-8 without control characters other than newlines and tabs: every other
/// byte is written as \xNN. Error messages quote names and bytes read from files and frames,
/// which may be anything; a message is printed, logged and sent as JSON.
inline std::string printable(const std::string& text) {
  static const char* const hex = "0123456789abcdef";
  std::string out;
  out.reserve(text.size());
  auto byte = [&](std::size_t i) { return static_cast<unsigned char>(text[i]); };
  for (std::size_t i = 0; i < text.size();) {
    auto c = byte(i);
    std::size_t n = c < 0x80                 ? 1
                    : c >= 0xc2 && c <= 0xdf ? 2
                    : c >= 0xe0 && c <= 0xef ? 3
                    : c >= 0xf0 && c <= 0xf4 ? 4
                                             : 0;
    bool ok =
      n == 1 ? (c >= 0x20 && c != 0x7f) || c == '\n' || c == '\t' : n > 0 && i + n <= text.size();
    for (std::size_t k = 1; ok && k < n; ++k) {
      ok = (byte(i + k) & 0xc0) == 0x80;
    }
    if (ok && n >= 3) { // no overlong forms, surrogates or code points past U+10FFFF
      auto next = byte(i + 1);
      ok = !((c == 0xe0 && next < 0xa0) || (c == 0xed && next >= 0xa0) ||
             (c == 0xf0 && next < 0x90) || (c == 0xf4 && next >= 0x90));
    }
    if (ok) {
      out.append(text, i, n);
      i += n;
    } else {
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
      ++i;
    }
  }
  return out;
}

} // namespace detail

/// Thrown when a caller passes something that cannot work (bad option, unknown name, cut out of
/// range). Nothing has been changed when it is thrown. The message is printable UTF-8
/// (detail::printable).
class invalid_argument : public std::invalid_argument {
public:
  explicit invalid_argument(const std::string& message)
    : std::invalid_argument(detail::printable(message)) {}
  explicit invalid_argument(const char* message)
    : std::invalid_argument(detail::printable(message)) {}
};

/// What went wrong in a failed step or request, as a pipeline_error reports it. A kind is one
/// enumerator here and one row of error_kinds below (its name and what a run does about it); the
/// numbers it travels as (a CAF error's code, a node's wire byte) are its position, read back by
/// error_kind_from_number. docs/architecture.md, "Where to add", has the steps.
enum class error_kind : uint8_t {
  /// Not classified further (the message says what).
  other,
  /// A wait or request passed its deadline: a stage waiting for its neighbour, the step's own
  /// deadline, a stage that did not answer a request. Retrying may help; a slow stage may need
  /// a longer wait_timeout.
  timeout,
  /// A tensor did not fit where it arrived: the activation a stage received, a loss target, a
  /// checkpoint tensor of another shape.
  shape_mismatch,
  /// A stage's own work threw: a layer, the loss function, a hook, the optimizer.
  stage_failure,
  /// A stage actor in this process terminated; the pipeline cannot run further steps.
  stage_lost,
  /// A node hosting stages was lost: its connection closed or it stopped answering.
  node_lost,
  /// A collective with the other data-parallel replicas failed or passed its deadline.
  replica_failure,
  /// A file could not be read or written, or is not what it should be (checkpoints).
  io,
  /// A stage's device ran out of memory (the message names the stage, the micro-batch and what
  /// was asked for); the step failed and changed nothing.
  out_of_memory,
  /// A file system had no room for a file being written (a checkpoint's stage file or manifest:
  /// the message names the file, its size and the space left); the checkpoints written before
  /// are as they were.
  disk_full,
};

/// What a training run (train(), `actorpipe train`) does when a step or checkpoint fails with a
/// kind. An application's own loop may ask the same (reaction_to).
enum class fault_reaction : uint8_t {
  /// The run ends with the error; parameters and the checkpoints written before are as they were.
  give_up,
  /// With train_options::recover_lost_nodes: the nodes are counted, a lost one is replaced by a
  /// spare or the model re-cut over those left, the newest snapshot (or a surviving replica's
  /// live state) is restored and the steps since are run again (pipeline::recover).
  recover,
};

/// One kind: its name, and the reaction of a run of one pipeline and of replicas in this process.
struct error_kind_row {
  error_kind kind;
  const char* name;
  fault_reaction alone;
  fault_reaction replicated;
};

/// Every kind, in the enum's order (tests/nodes/error_kinds_test.cpp fails for a kind without a
/// row). A frozen node is found by its timeout; replicas also recover from a replica whose
/// partner stage went (its gradients' all-reduce failed).
inline constexpr error_kind_row error_kinds[] = {
  {error_kind::other, "other", fault_reaction::give_up, fault_reaction::give_up},
  {error_kind::timeout, "timeout", fault_reaction::recover, fault_reaction::recover},
  {error_kind::shape_mismatch, "shape_mismatch", fault_reaction::give_up, fault_reaction::give_up},
  {error_kind::stage_failure, "stage_failure", fault_reaction::give_up, fault_reaction::give_up},
  {error_kind::stage_lost, "stage_lost", fault_reaction::give_up, fault_reaction::give_up},
  {error_kind::node_lost, "node_lost", fault_reaction::recover, fault_reaction::recover},
  {error_kind::replica_failure, "replica_failure", fault_reaction::give_up,
   fault_reaction::recover},
  {error_kind::io, "io", fault_reaction::give_up, fault_reaction::give_up},
  {error_kind::out_of_memory, "out_of_memory", fault_reaction::give_up, fault_reaction::give_up},
  {error_kind::disk_full, "disk_full", fault_reaction::give_up, fault_reaction::give_up},
};

inline constexpr std::size_t error_kind_count = sizeof(error_kinds) / sizeof(error_kinds[0]);

namespace detail {
constexpr bool rows_in_enum_order() {
  for (std::size_t i = 0; i < error_kind_count; ++i) {
    if (static_cast<std::size_t>(error_kinds[i].kind) != i) {
      return false;
    }
  }
  return true;
}
static_assert(rows_in_enum_order(), "error_kinds: one row per error_kind, in the enum's order");
} // namespace detail

/// The kind at position `number` (a CAF error's code less one, a node's wire byte); nothing for
/// a number this build does not know (a newer peer's kind).
inline std::optional<error_kind> error_kind_from_number(std::size_t number) {
  return number < error_kind_count ? std::optional<error_kind>(error_kinds[number].kind)
                                   : std::nullopt;
}

/// The row of `kind` (other's for a value without one).
inline const error_kind_row& row_of(error_kind kind) {
  auto at = static_cast<std::size_t>(kind);
  return error_kinds[at < error_kind_count ? at : 0];
}

/// "timeout", "shape_mismatch", ... (the enumerator's name).
inline const char* to_string(error_kind kind) {
  return row_of(kind).name;
}

/// What a run does about a failure of `kind` (`replicated`: replicas in this process).
inline fault_reaction reaction_to(error_kind kind, bool replicated) {
  const auto& row = row_of(kind);
  return replicated ? row.replicated : row.alone;
}

/// Where and how a step failed; every field the failure does not concern stays empty.
struct error_details {
  error_details() = default;
  /// Fields in the order a failure is usually known: what, where, when, on which node.
  error_details(error_kind kind_, std::optional<std::size_t> stage_ = std::nullopt,
                std::optional<int32_t> microbatch_ = std::nullopt,
                std::optional<uint64_t> step_ = std::nullopt, std::string node_ = {})
    : kind(kind_), stage(stage_), microbatch(microbatch_), step(step_), node(std::move(node_)) {}

  error_kind kind = error_kind::other;
  /// The stage actor at fault (or the one that noticed: a stage that waited names itself and,
  /// in the message, the neighbour it waited for).
  std::optional<std::size_t> stage;
  std::optional<int32_t> microbatch;
  /// The pipeline's 1-based step counter.
  std::optional<uint64_t> step;
  /// "host:port" of the node concerned, for stages on nodes.
  std::string node;
};

/// One failure among several that a request ended with (a save that failed on two stages): its
/// fields and its sentence.
struct failure_part {
  error_details details;
  std::string message;
};

/// Thrown (or carried by a failed step) when a pipeline step fails at run time: a stage could
/// not take its input, a wait ran past its deadline, a stage died. The message names the stage,
/// the micro-batch and the action; details() carries the same as fields. A failed step leaves
/// parameters and buffers as they were. The message is printable UTF-8 (detail::printable).
class pipeline_error : public std::runtime_error {
public:
  explicit pipeline_error(const std::string& message, error_details details = {})
    : std::runtime_error(detail::printable(message)), details_(std::move(details)) {}
  explicit pipeline_error(const char* message, error_details details = {})
    : std::runtime_error(detail::printable(message)), details_(std::move(details)) {}
  /// Several stages failed: the message joins theirs, `details` are the most telling one's.
  pipeline_error(const std::string& message, error_details details,
                 std::vector<failure_part> failures)
    : std::runtime_error(detail::printable(message)), details_(std::move(details)),
      failures_(std::move(failures)) {}

  const error_details& details() const noexcept { return details_; }
  error_kind kind() const noexcept { return details_.kind; }
  std::optional<std::size_t> stage() const noexcept { return details_.stage; }
  std::optional<int32_t> microbatch() const noexcept { return details_.microbatch; }
  std::optional<uint64_t> step() const noexcept { return details_.step; }
  const std::string& node() const noexcept { return details_.node; }
  /// When several stages failed (a save, a load, a state fetch): each one's failure, in stage
  /// order, with its own fields; empty when one did.
  const std::vector<failure_part>& failures() const noexcept { return failures_; }

private:
  error_details details_;
  std::vector<failure_part> failures_;
};

/// The kind `e` carries when it is a pipeline_error, else `otherwise`: a handler that reports a
/// failure in its own words keeps its kind (a full disk stays disk_full).
inline error_kind kind_of(const std::exception& e, error_kind otherwise) {
  const auto* failure = dynamic_cast<const pipeline_error*>(&e);
  return failure != nullptr ? failure->kind() : otherwise;
}

namespace detail {

template <class... Ts>
std::string concat(Ts&&... xs) {
  std::ostringstream out;
  (out << ... << std::forward<Ts>(xs));
  return out.str();
}

/// The first line of a libtorch message: the rest is a C++ or TorchScript backtrace users
/// cannot act on.
inline std::string first_line(const std::string& text) {
  return text.substr(0, text.find('\n'));
}

[[noreturn]] inline void assertion_failed(const char* condition, const char* file, int line) {
  std::fprintf(stderr, "actorpipe: assertion failed: %s (%s:%d)\n", condition, file, line);
  std::abort();
}

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
