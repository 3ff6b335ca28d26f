#include "nodes/protocol.hpp"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/rand.h>

#include <caf/actor_system_config.hpp>
#include <nlohmann/json.hpp>

#include <actorpipe/schedule.hpp>

#include "comm/tensor_hub.hpp"
#include "nodes/option_fields.hpp"

namespace actorpipe::nodes {

using json = nlohmann::json;

namespace {

json parse(const std::string& text, const char* what) {
  try {
    return json::parse(text);
  } catch (const json::exception& e) {
    throw invalid_argument(detail::concat(what, ": not valid JSON: ", e.what()));
  }
}

template <class T>
T field(const json& j, const char* key, const char* what) {
  auto it = j.find(key);
  if (it == j.end()) {
    throw invalid_argument(detail::concat(what, ": field '", key, "' is missing"));
  }
  try {
    return it->get<T>();
  } catch (const json::exception& e) {
    throw invalid_argument(detail::concat(what, ": field '", key, "' is malformed: ", e.what()));
  }
}

endpoint endpoint_from(const json& j, const char* what) {
  auto port = field<int64_t>(j, "port", what);
  if (port < 1 || port > 65535) {
    throw invalid_argument(detail::concat(what, ": port ", port, " out of range"));
  }
  return {field<std::string>(j, "host", what), static_cast<uint16_t>(port),
          field<std::string>(j, "node", what)};
}

json endpoint_json(const endpoint& e) {
  return {{"host", e.host}, {"port", e.port}, {"node", e.node}};
}

// A stage setting as JSON, and back (naming the field when it is wrong): one overload per type
// that stage_settings holds.
json encode(std::size_t v) {
  return v;
}
json encode(int64_t v) {
  return v;
}
json encode(int32_t v) {
  return v;
}
json encode(double v) {
  return v;
}
json encode(bool v) {
  return v;
}
json encode(const std::string& v) {
  return v;
}
json encode(const std::vector<double>& v) {
  return v;
}
json encode(chunk_placement v) {
  return to_string(v);
}
json encode(const c10::Device& v) {
  return v.str();
}
json encode(std::chrono::milliseconds v) {
  return v.count();
}
json encode(std::chrono::microseconds v) {
  return v.count();
}
json encode(loss_reduction v) {
  return v == loss_reduction::mean ? "mean" : "sum";
}
json encode(recompute_mode v) {
  return to_string(v);
}
json encode(precision_mode v) {
  return to_string(v);
}
json encode(cuda_graph_mode v) {
  return to_string(v);
}
json encode(buffer_sync v) {
  return to_string(v);
}
json encode(shard_mode v) {
  return to_string(v);
}

template <class T>
void decode(const json& j, T& v) {
  v = j.get<T>();
}
void decode(const json& j, chunk_placement& v) {
  v = parse_chunk_placement(j.get<std::string>());
}
void decode(const json& j, c10::Device& v) {
  v = c10::Device(j.get<std::string>());
}
void decode(const json& j, std::chrono::milliseconds& v) {
  v = std::chrono::milliseconds(j.get<int64_t>());
}
void decode(const json& j, std::chrono::microseconds& v) {
  v = std::chrono::microseconds(j.get<int64_t>());
}
void decode(const json& j, recompute_mode& v) {
  v = parse_recompute_mode(j.get<std::string>());
}
void decode(const json& j, precision_mode& v) {
  v = parse_precision(j.get<std::string>());
}
void decode(const json& j, cuda_graph_mode& v) {
  v = parse_cuda_graph_mode(j.get<std::string>());
}
void decode(const json& j, loss_reduction& v) {
  auto text = j.get<std::string>();
  ACTORPIPE_CHECK(text == "mean" || text == "sum", "unknown reduction '", text, "'");
  v = text == "mean" ? loss_reduction::mean : loss_reduction::sum;
}
void decode(const json& j, buffer_sync& v) {
  v = parse_buffer_sync(j.get<std::string>());
}
void decode(const json& j, shard_mode& v) {
  v = parse_shard_mode(j.get<std::string>());
}

// The fields `visit` lists of `v` into the JSON object `j`, and back, naming a field that is
// missing or malformed: the one serializer and parser of every field list (stage_settings' and
// option_fields.hpp's).
template <class T, class Visit>
void write_fields(json& j, const T& v, Visit visit) {
  visit(v, [&](const char* name, const auto& value) { j[name] = encode(value); });
}

// A message's text: `j` (what it carries beside its fields) with the fields `visit` lists.
template <class T, class Visit>
std::string message_text(json j, const T& v, Visit visit) {
  write_fields(j, v, visit);
  return j.dump();
}

template <class T, class Visit>
void read_fields(const json& j, T& v, Visit visit, const char* what) {
  visit(v, [&](const char* name, auto& value) {
    auto item = field<json>(j, name, what);
    try {
      decode(item, value);
    } catch (const std::exception& e) {
      throw invalid_argument(
        detail::concat(what, ": field '", name, "' is malformed: ", detail::first_line(e.what())));
    }
  });
}

constexpr auto settings_fields = [](auto& s, auto&& f) { visit_fields(s, f); };
constexpr auto model_fields = [](auto& o, auto&& f) { visit_model_options(o, f); };
constexpr auto optimizer_fields = [](auto& o, auto&& f) { visit_optimizer_spec(o, f); };
constexpr auto hook_fields = [](auto& h, auto&& f) { visit_hook_spec(h, f); };
// What a step plan and a stage report carry beside their tensors (sent as frames), their
// programs and action records: origin_ns and overlapped stay in the process (a node's stages
// time from their own clock and do not overlap steps), outputs go as frames.
constexpr auto plan_fields = [](auto& p, auto&& f) {
  f("step", p.step);
  f("train", p.train);
  f("microbatches", p.microbatches);
  f("loss_scales", p.loss_scales);
  f("samples", p.samples);
  f("learning_rate", p.learning_rate);
  f("optimistic", p.optimistic);
};
constexpr auto report_fields = [](auto& r, auto&& f) {
  f("step", r.step);
  f("loss", r.loss);
  f("gradient_square_sum", r.gradient_square_sum);
  visit_scalars(r.stats, f);
};

// A message's JSON (into `j`, for what is not a listed field) and a T of the fields `visit`
// lists, read from it.
template <class T, class Visit>
T read_message(const std::string& text, const char* what, Visit visit, json& j) {
  j = parse(text, what);
  T value;
  read_fields(j, value, visit, what);
  return value;
}

json settings_json(const stage_settings& s) {
  json j = {{"version", stage_settings::version}};
  write_fields(j, s, settings_fields);
  return j;
}

stage_settings settings_from(const json& j, const char* what) {
  auto version = field<int>(j, "version", what);
  ACTORPIPE_CHECK(version == stage_settings::version, what, ": settings of version ", version,
                  ", this node reads version ", stage_settings::version,
                  " (driver and node are different builds of actorpipe)");
  stage_settings s;
  read_fields(j, s, settings_fields, what);
  ACTORPIPE_CHECK(s.chunks >= 1 && s.chunks <= 1024, what, ": chunks ", s.chunks);
  ACTORPIPE_CHECK(s.count >= 1 && s.index < s.count, what, ": stage ", s.index, " of ", s.count);
  ACTORPIPE_CHECK(s.threads >= 1 && s.threads <= 1024, what, ": threads ", s.threads);
  ACTORPIPE_CHECK(s.wait_timeout.count() >= 1, what, ": wait_timeout ", s.wait_timeout.count());
  ACTORPIPE_CHECK(s.linger.count() >= 0, what, ": linger ", s.linger.count());
  return s;
}

} // namespace

std::string to_hex(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) {
    out += digits[c >> 4];
    out += digits[c & 15];
  }
  return out;
}

std::string new_challenge() {
  std::string challenge(32, '\0');
  RAND_bytes(reinterpret_cast<unsigned char*>(challenge.data()), 32);
  return to_hex(challenge);
}

bool answers_challenge(const std::string& secret, const std::string& challenge,
                       const std::string& answer) {
  auto expected = to_hex(comm::handshake_answer(secret, challenge));
  return answer.size() == expected.size() &&
         CRYPTO_memcmp(answer.data(), expected.data(), expected.size()) == 0;
}

std::string model_digest(const std::string& bytes) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  ACTORPIPE_CHECK(EVP_Digest(bytes.data(), bytes.size(), digest, &length, EVP_sha256(), nullptr) ==
                    1,
                  "SHA-256 failed");
  return to_hex(std::string(reinterpret_cast<const char*>(digest), length));
}

std::array<std::string*, 3> file_fields(remote_model& model) {
  return {&model.file, &model.hooks.after_forward.torchscript,
          &model.hooks.after_backward.torchscript};
}

std::array<const std::string*, 3> file_fields(const remote_model& model) {
  return {&model.file, &model.hooks.after_forward.torchscript,
          &model.hooks.after_backward.torchscript};
}

remote_model by_digest(remote_model model) {
  for (auto* text : file_fields(model)) {
    if (!text->empty()) {
      *text = model_digest(*text);
    }
  }
  return model;
}

std::pair<std::string, uint16_t> parse_host_port(const std::string& text, const std::string& what) {
  auto colon = text.rfind(':');
  ACTORPIPE_CHECK(colon != std::string::npos && colon > 0 && colon + 1 < text.size(), what, " '",
                  text, "' is not HOST:PORT");
  auto host = text.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  int64_t port = 0;
  for (auto c : text.substr(colon + 1)) {
    ACTORPIPE_CHECK(c >= '0' && c <= '9', what, " '", text, "' has a port that is not a number");
    port = port * 10 + (c - '0');
    ACTORPIPE_CHECK(port <= 65535, what, " '", text, "' has a port above 65535");
  }
  return {host, static_cast<uint16_t>(port)};
}

namespace {

// A remote_model: its name, seed, model file's bytes, segments and loss, its options' fields beside
// them, and its hooks and optimizer as objects of their fields.
json model_json(const remote_model& m) {
  json j = {{"name", m.name},
            {"seed", m.seed},
            {"file", m.file},
            {"segments", m.segments},
            {"loss", m.loss}};
  write_fields(j, m.options, model_fields);
  json hooks = {{"after_forward", json::object()}, {"after_backward", json::object()}};
  write_fields(hooks["after_forward"], m.hooks.after_forward, hook_fields);
  write_fields(hooks["after_backward"], m.hooks.after_backward, hook_fields);
  j["hooks"] = std::move(hooks);
  json optimizer = json::object();
  write_fields(optimizer, m.optimizer, optimizer_fields);
  j["optimizer"] = std::move(optimizer);
  return j;
}

remote_model model_from(const json& j, const char* what) {
  remote_model m;
  m.name = field<std::string>(j, "name", what);
  m.seed = field<uint64_t>(j, "seed", what);
  m.file = field<std::string>(j, "file", what);
  m.segments = field<std::string>(j, "segments", what);
  m.loss = field<std::string>(j, "loss", what);
  read_fields(j, m.options, model_fields, what);
  auto hooks = field<json>(j, "hooks", what);
  read_fields(field<json>(hooks, "after_forward", what), m.hooks.after_forward, hook_fields, what);
  read_fields(field<json>(hooks, "after_backward", what), m.hooks.after_backward, hook_fields,
              what);
  read_fields(field<json>(j, "optimizer", what), m.optimizer, optimizer_fields, what);
  return m;
}

} // namespace

std::string to_json(const stage_spec& s) {
  json j = {
    {"model", model_json(s.model)}, {"bounds", s.bounds}, {"settings", settings_json(s.settings)}};
  const auto& dp = s.data_parallel;
  if (dp.replicas > 1) {
    j["data_parallel"] = {{"rank", dp.rank},
                          {"replicas", dp.replicas},
                          {"master_addr", dp.master_addr},
                          {"master_port", dp.master_port},
                          {"timeout_ms", dp.timeout.count()},
                          {"bucket_bytes", dp.bucket_bytes},
                          {"group", dp.group},
                          {"group_prefix", s.group_prefix}};
  }
  return j.dump();
}

stage_spec stage_spec_from_json(const std::string& text) {
  const char* what = "stage spec";
  auto j = parse(text, what);
  stage_spec s;
  s.model = model_from(field<json>(j, "model", what), what);
  s.bounds = field<std::vector<std::size_t>>(j, "bounds", what);
  s.settings = settings_from(field<json>(j, "settings", what), what);
  const auto& st = s.settings;
  ACTORPIPE_CHECK(s.bounds.size() == st.count * st.chunks + 1, what, ": stage ", st.index, " of ",
                  st.count, " with ", st.chunks, " chunks and ", s.bounds.size(), " bounds");
  if (j.contains("data_parallel")) {
    auto d = field<json>(j, "data_parallel", what);
    auto& dp = s.data_parallel;
    dp.rank = field<std::size_t>(d, "rank", what);
    dp.replicas = field<std::size_t>(d, "replicas", what);
    dp.master_addr = field<std::string>(d, "master_addr", what);
    auto port = field<int64_t>(d, "master_port", what);
    ACTORPIPE_CHECK(port >= 1 && port <= 65535, what, ": master_port ", port);
    dp.master_port = static_cast<uint16_t>(port);
    dp.timeout = std::chrono::milliseconds(field<int64_t>(d, "timeout_ms", what));
    dp.bucket_bytes = field<std::size_t>(d, "bucket_bytes", what);
    dp.group = field<std::string>(d, "group", what); // where failed steps are announced
    dp.buffers = s.settings.buffers;
    dp.sync_batch_norm = s.settings.sync_batch_norm;
    s.group_prefix = field<std::string>(d, "group_prefix", what);
    ACTORPIPE_CHECK(dp.replicas >= 2 && dp.rank < dp.replicas, what, ": data parallel rank ",
                    dp.rank, " of ", dp.replicas);
    ACTORPIPE_CHECK(dp.timeout.count() >= 1 && dp.bucket_bytes >= 1 && !s.group_prefix.empty() &&
                      !dp.master_addr.empty(),
                    what, ": data parallel timeout, bucket bytes, group prefix or master address");
  }
  return s;
}

std::string to_json(const stage_settings& settings) {
  return settings_json(settings).dump();
}

stage_settings stage_settings_from_json(const std::string& text) {
  return settings_from(parse(text, "stage settings"), "stage settings");
}

std::string to_json(const peer_table& peers) {
  json stages = json::array();
  for (const auto& e : peers.stages) {
    stages.push_back(endpoint_json(e));
  }
  return json{{"stages", stages}, {"scheduler", endpoint_json(peers.scheduler)}}.dump();
}

peer_table peer_table_from_json(const std::string& text) {
  const char* what = "peer table";
  auto j = parse(text, what);
  peer_table peers;
  for (const auto& e : field<json>(j, "stages", what)) {
    peers.stages.push_back(endpoint_from(e, what));
  }
  peers.scheduler = endpoint_from(field<json>(j, "scheduler", what), what);
  return peers;
}

std::string to_json(const actors::step_plan& plan, std::size_t targets) {
  json program = json::array();
  for (const auto& a : plan.program) {
    program.push_back({static_cast<int>(a.kind), a.microbatch, a.chunk});
  }
  return message_text({{"program", program}, {"targets", targets}}, plan, plan_fields);
}

actors::step_plan step_plan_from_json(const std::string& text, std::size_t& targets) {
  const char* what = "step plan";
  json j;
  auto plan = read_message<actors::step_plan>(text, what, plan_fields, j);
  ACTORPIPE_CHECK(plan.microbatches >= 1 && plan.microbatches < (1 << 30), what, ": ",
                  plan.microbatches, " micro-batches");
  for (const auto& a : field<std::vector<std::array<int64_t, 3>>>(j, "program", what)) {
    ACTORPIPE_CHECK(a[0] >= 0 && a[0] <= 2 && a[1] >= 0 && a[1] < plan.microbatches && a[2] >= 0 &&
                      a[2] < 1024,
                    what, ": malformed action [", a[0], ", ", a[1], ", ", a[2], "] (",
                    plan.microbatches, " micro-batches)");
    plan.program.push_back(
      {static_cast<action_kind>(a[0]), static_cast<int32_t>(a[1]), static_cast<int32_t>(a[2])});
  }
  targets = field<std::size_t>(j, "targets", what);
  ACTORPIPE_CHECK(targets <= (1u << 20) && (targets == 0 || targets == plan.loss_scales.size()),
                  what, ": ", targets, " targets for ", plan.loss_scales.size(), " loss scales");
  return plan;
}

std::string to_json(const actors::stage_report& r) {
  const auto& s = r.stats;
  json actions = json::array();
  for (const auto& a : s.actions) {
    actions.push_back({static_cast<int>(a.what.kind), a.what.microbatch, a.what.chunk, a.start_ms,
                       a.end_ms, a.bytes_sent, a.device_start_ms, a.device_end_ms});
  }
  return message_text({{"outputs", r.outputs.size()}, {"actions", actions}}, r, report_fields);
}

actors::stage_report stage_report_from_json(const std::string& text, std::size_t& outputs) {
  const char* what = "stage report";
  json j;
  auto r = read_message<actors::stage_report>(text, what, report_fields, j);
  outputs = field<std::size_t>(j, "outputs", what);
  auto& s = r.stats;
  for (const auto& a : field<json>(j, "actions", what)) {
    action_record rec;
    rec.what = {static_cast<action_kind>(a.at(0).get<int>()), a.at(1).get<int32_t>(),
                a.at(2).get<int32_t>()};
    rec.start_ms = a.at(3).get<double>();
    rec.end_ms = a.at(4).get<double>();
    rec.bytes_sent = a.at(5).get<int64_t>();
    if (a.size() >= 8) { // the device's times (a stage on a GPU)
      rec.device_start_ms = a.at(6).get<double>();
      rec.device_end_ms = a.at(7).get<double>();
    }
    s.actions.push_back(rec);
  }
  return r;
}

void set_tls_identity(caf::actor_system_config& cfg, const tls_options& tls) {
  cfg.openssl_certificate = tls.certificate;
  cfg.openssl_key = tls.private_key;
  cfg.openssl_cafile = tls.ca_file;
}

} // namespace actorpipe::nodes
