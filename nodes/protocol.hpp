/// \file
/// The control protocol between a scheduler process and `actorpipe node` processes (CAF
/// messages of built-in types; structured parts as JSON text, validated on read). Tensors never
/// travel here: they cross in comm/'s frames.
///
/// node actor (published by `actorpipe node`), every message but hello/auth refused until the
/// sender's process has answered the challenge:
/// - (hello_atom) -> std::string challenge
/// - (auth_atom, std::string answer) -> true; the answer is HMAC-SHA256(secret, challenge), hex.
/// - (model_atom, std::string digest, std::string bytes) -> true: a model file (TorchScript or
///   PT2), kept by its SHA-256 (hex) for the build requests that name it; refused above the
///   node's max_model_bytes or when the bytes do not hash to the digest.
/// - (build_atom, std::string stage_spec) -> std::string {"data_host", "data_port", "settings":
///   the stage settings the stage actor was given}
/// - (wire_atom, uint32 stage, std::string peers, caf::actor proxy) -> true: where the other
///   stages and the scheduler receive frames; the proxy gets the reports and is monitored (the
///   stage is dropped when it goes).
/// A setup request the node refuses (an unanswered challenge, a wrong secret, a model too large
/// or damaged, a stage it cannot build or wire) is answered with an `actorpipe` error
/// (actors/pipeline_errc.hpp): the kind of what failed, the node, the stage where there is one,
/// the sentence; the driver adds the stage it asked for (nodes/remote_stages.cpp, `ask`).
/// - the stage protocol's messages for one of the node's stages (node_stage_actor below: the
///   stage's atom, its index, then the message in wire form)
/// - (keep_atom, uint32 stage, uint64 number, std::string note) -> bool: snapshot `number` came
///   whole to the driver: the node keeps it, with the driver's note, in place of the one before
///   (false: the pending state is another's, or the node keeps none). Kept after the stage went,
///   for node_options::keep_snapshots.
/// - (copy_atom, uint32 stage, uint64 number, std::string host, uint16 port) -> bool: the node
///   sends its kept snapshot `number` of stage `stage` (its own stage's, else the copy it holds
///   of a neighbour's) to the node whose data port is host:port (a state frame whose id is
///   number | copy_bit), beside its stages' work (false: it keeps another or none)
/// - (hold_atom, uint32 stage, uint64 number, std::string note) -> bool: a copy of another
///   node's stage `stage`, snapshot `number`, is on its way here (copy_atom): the node keeps it
///   beside its own once it came, in place of the copy before, with `note` (false: it keeps
///   none, node_options::keep_snapshots 0)
/// - (kept_atom) -> std::string: the kept snapshots, [{"stage", "number", "note", "copy"}, ...]
///   (copy: a neighbour's stage, held for it)
/// - (rrestore_atom, uint32 stage, uint64 number) -> true: the stage (built anew, by a driver
///   that started again, or placed anew after a loss) loads kept snapshot `number` of its index,
///   its own or a copy it holds; a copy on its way (its note here, or its bytes) is loaded, and
///   the request answered, once it came
/// - (release_atom, uint32 stage): drop the stage.
/// - (heartbeat_atom) -> bool: answered at once by the node actor, beside its stages' work; a
///   node that leaves it unanswered past node_placement::heartbeat_timeout counts as lost.
/// proxy (scheduler side): a stage's report and failure (node_report_listener below).
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include <caf/atom.hpp>
#include <caf/fwd.hpp>
#include <caf/replies_to.hpp>
#include <caf/typed_actor.hpp>
#include <nlohmann/json_fwd.hpp>

#include <actorpipe/options.hpp>
#include <actorpipe/stage_settings.hpp>
#include <actorpipe/tls.hpp>

#include "actors/messages.hpp"

namespace actorpipe::nodes {

using hello_atom = caf::atom_constant<caf::atom("hello")>;
using auth_atom = caf::atom_constant<caf::atom("auth")>;
using build_atom = caf::atom_constant<caf::atom("build")>;
using model_atom = caf::atom_constant<caf::atom("model")>;
using wire_atom = caf::atom_constant<caf::atom("wire")>;
using release_atom = caf::atom_constant<caf::atom("release")>;
using keep_atom = caf::atom_constant<caf::atom("keep")>;
using kept_atom = caf::atom_constant<caf::atom("kept")>;
using copy_atom = caf::atom_constant<caf::atom("copy")>;
using hold_atom = caf::atom_constant<caf::atom("hold")>;
using rrestore_atom = caf::atom_constant<caf::atom("rrestore")>;
using heartbeat_atom = caf::atom_constant<caf::atom("heartbeat")>;
/// A node announcing itself to a driver's join listener (nodes/join.hpp).
using join_atom = caf::atom_constant<caf::atom("join")>;
/// Local only (hub reader threads -> actors): frames that are not activations or gradients.
using target_atom = caf::atom_constant<caf::atom("target")>;
using output_atom = caf::atom_constant<caf::atom("output")>;
using state_atom = caf::atom_constant<caf::atom("state")>;
/// Local only: the node's kept snapshots go when no stage came for their keep time.
using expire_atom = caf::atom_constant<caf::atom("expire")>;

/// The stage protocol (actors/messages.hpp) as a node takes it for one of its stages, declared
/// once: the proxy's requests compile against it and the node's handlers are a behaviour of it
/// (a message or reply of another type does not build on either side). Each message is the
/// stage's own, with the stage's index first and what does not cross as a CAF value in wire form:
/// - (plan_atom, uint32 stage, std::string plan): run a step (the plan as JSON, to_json); the
///   first stage's inputs come as activation frames, the last stage's targets as target frames.
/// - (abort_atom, uint32 stage, uint64 step) -> bool
/// - (update_atom, uint32 stage, uint64 step, double lr, double scale) -> double optimizer_ms
/// - (save_atom, uint32 stage, uint64 id, uint64 keep_as) -> true, after sending the state as
///   frame `id`; for a snapshot (keep_as > 0: its number) packed into the stage's pending buffer
/// - (load_atom, uint32 stage, uint64 id) -> true, once the state frame `id` came and loaded
/// - (block_atom, uint32 stage) -> true: the stage's end_block (replicas with a sharded
///   optimizer: its state gathered on rank 0's stage for a checkpoint)
/// A request that fails is answered with a refusal of category `actorpipe`
/// (actors/pipeline_errc.hpp: the error_kind, the sentence and the failure's fields), as the
/// stage protocol's replies are.
using node_stage_actor = caf::typed_actor<
  caf::reacts_to<actors::plan_atom, uint32_t, std::string>,
  caf::replies_to<actors::abort_atom, uint32_t, uint64_t>::with<bool>,
  caf::replies_to<actors::update_atom, uint32_t, uint64_t, double, double>::with<double>,
  caf::replies_to<actors::save_atom, uint32_t, uint64_t, uint64_t>::with<bool>,
  caf::replies_to<actors::load_atom, uint32_t, uint64_t>::with<bool>,
  caf::replies_to<actors::block_atom, uint32_t>::with<bool>>;

/// What a node tells a stage's proxy, the stage listener's messages (actors/messages.hpp) in
/// wire form:
/// - (done_atom, uint32 stage, std::string report), then output frames when forward-only
/// - (failed_atom, uint32 stage, uint64 step, uint8 kind, int32 microbatch, std::string node,
///   std::string message): the step failed; kind is an error_kind (error_kind_to_wire),
///   microbatch -1 when none, node the node concerned when it is not the stage's own.
using node_report_listener =
  caf::typed_actor<caf::reacts_to<actors::done_atom, uint32_t, std::string>,
                   caf::reacts_to<actors::failed_atom, uint32_t, uint64_t, uint8_t, int32_t,
                                  std::string, std::string>>;

/// What a node needs to build stage actor `index` of `count`, holding `chunks` parts of the
/// model (chunk c is virtual stage virtual_stage_of(placement, count, index, c), as in process).
/// For a model file (TorchScript or PT2), `model.file` holds its digest (model_digest), not its
/// bytes, and so does a TorchScript hook's (by_digest).
struct stage_spec {
  remote_model model;
  std::vector<std::size_t> bounds;
  /// Everything the stage actor needs to know, whole, as a stage in process gets it.
  stage_settings settings;
  /// Replicas (data_parallel.replicas > 1): this stage's rank, where rank 0's driver serves the
  /// store (master_addr:master_port), its deadline and buckets; the stage forms its group under
  /// `group_prefix` (data_parallel.local and bmuf are not used; the settings carry buffers,
  /// batch norm and sharding).
  data_parallel_options data_parallel;
  std::string group_prefix;
};

/// The bit of a state frame's id that marks a neighbour's kept snapshot (copy_atom): the rest of
/// the id is the snapshot's number.
constexpr uint64_t copy_bit = uint64_t{1} << 63;

/// Where a stage receives frames, and the node that hosts it ("host:port" of its control).
struct endpoint {
  std::string host;
  uint16_t port = 0;
  std::string node;
};

/// Every stage's data endpoint and the scheduler's.
struct peer_table {
  std::vector<endpoint> stages;
  endpoint scheduler;
};

std::string to_json(const stage_spec& spec);
/// Stage settings alone, as a spec carries them (with their version).
std::string to_json(const stage_settings& settings);
std::string to_json(const peer_table& peers);
/// The plan without tensors; `targets` is how many target frames the last stage waits for.
std::string to_json(const actors::step_plan& plan, std::size_t targets);
std::string to_json(const actors::stage_report& report);

/// The readers throw invalid_argument naming the field that is missing or wrong.
stage_spec stage_spec_from_json(const std::string& text);
stage_settings stage_settings_from_json(const std::string& text);
peer_table peer_table_from_json(const std::string& text);
actors::step_plan step_plan_from_json(const std::string& text, std::size_t& targets);
actors::stage_report stage_report_from_json(const std::string& text, std::size_t& outputs);

/// "host:port" split; throws invalid_argument naming `what` for anything else.
std::pair<std::string, uint16_t> parse_host_port(const std::string& text, const std::string& what);

std::string to_hex(const std::string& bytes);

/// A fresh random challenge (32 bytes, hex), for a peer to answer with the shared secret.
std::string new_challenge();
/// Whether `answer` is the answer to `challenge` with `secret` (compared in constant time).
bool answers_challenge(const std::string& secret, const std::string& challenge,
                       const std::string& answer);

/// SHA-256 of `bytes`, hex: how a model file is named between scheduler and node.
std::string model_digest(const std::string& bytes);

/// The file fields of `model`, empty or not: the model's file, then each hook's TorchScript.
std::array<std::string*, 3> file_fields(remote_model& model);
std::array<const std::string*, 3> file_fields(const remote_model& model);

/// `model` with each file (the model's, the hooks') replaced by its digest, as a stage
/// spec carries it: the bytes go to each node once (the node's model message).
remote_model by_digest(remote_model model);

/// An error_kind as rfailed carries it, and back; an unknown number reads as error_kind::other.
inline uint8_t error_kind_to_wire(error_kind kind) {
  return static_cast<uint8_t>(kind);
}
inline error_kind error_kind_from_wire(uint8_t value) {
  return error_kind_from_number(value).value_or(error_kind::other);
}

/// Control over TLS: the identity CAF's OpenSSL module presents and the CA it checks peers
/// against. Set before the module makes its first connection (sessions read the config then).
void set_tls_identity(caf::actor_system_config& cfg, const tls_options& tls);

} // namespace actorpipe::nodes
