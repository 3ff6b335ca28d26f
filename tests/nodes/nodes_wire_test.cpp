// What crosses to a node whole: a stage's report, its settings, a model's options, a step's
// plan; and a device its node does not have.
#include "node_fixtures.hpp"

using namespace actorpipe;
using namespace actorpipe::test;
using namespace std::chrono_literals;

namespace {

// Stage settings with every field away from its default.
stage_settings unusual_settings() {
  stage_settings s;
  s.index = 1;
  s.count = 3;
  s.chunks = 2;
  s.placement = chunk_placement::v_shape;
  s.device = c10::Device(c10::kCUDA, 1);
  s.threads = 3;
  s.warm_memory = false;
  s.wait_timeout = 1234ms;
  s.linger = 0us;
  s.reduction = loss_reduction::sum;
  s.report_gradient_norm = true;
  s.device_timing = true;
  s.chunk_streams = false;
  s.recompute = recompute_mode::always;
  s.precision = precision_mode::bf16;
  s.cuda_graphs = cuda_graph_mode::automatic;
  s.buffers = buffer_sync::average;
  s.sync_batch_norm = true;
  s.shard = shard_mode::gradients;
  s.bmuf = {7, 0.5, 0.25, true, true, 2};
  return s;
}

// Each field's JSON, by name.
std::map<std::string, std::string> fields_of(const stage_settings& s) {
  auto j = nlohmann::json::parse(nodes::to_json(s));
  std::map<std::string, std::string> out;
  visit_fields(s, [&](const char* name, const auto&) { out[name] = j.at(name).dump(); });
  return out;
}

} // namespace

TEST_CASE("a stage's report crosses from a node whole: every figure of stage_stats") {
  // A figure added to stage_stats needs its line in visit_scalars (results.hpp: the node report,
  // train --json and Python's stats are made from that list); then update this size and count.
  static_assert(sizeof(stage_stats) == 152, "stage_stats changed: list the new field in "
                                            "visit_scalars (results.hpp), then update");
  actors::stage_report sent;
  sent.step = 7;
  auto& st = sent.stats;
  int n = 0;
  visit_scalars(st, [&](const char*, auto& value) {
    ++n;
    using T = std::decay_t<decltype(value)>;
    if constexpr (std::is_same_v<T, bool>) {
      value = true;
    } else {
      value = static_cast<T>(n * 3 + 1); // every field away from its default, each its own
    }
  });
  CHECK(n == 17);
  st.actions.push_back({{action_kind::forward, 2, 1}, 1.5, 2.5, 64, 1.75, 2.25});
  std::size_t outputs = 0;
  auto back = nodes::stage_report_from_json(nodes::to_json(sent), outputs);
  CHECK(back.step == 7);
  std::map<std::string, std::string> a, b;
  visit_scalars(st, [&](const char* name, const auto& value) { a[name] = std::to_string(value); });
  visit_scalars(back.stats,
                [&](const char* name, const auto& value) { b[name] = std::to_string(value); });
  CHECK(a == b);
  REQUIRE(back.stats.actions.size() == 1);
  CHECK(back.stats.actions[0].device_end_ms == 2.25);
}

TEST_CASE("stage settings cross to a node whole: every field, with a version, checked") {
  // A field added to stage_settings needs its line in visit_fields (the serializer, the parser
  // and this test walk that list); then update this size.
  static_assert(sizeof(stage_settings) == 136, "stage_settings changed: list the new field in "
                                               "visit_fields (stage_settings.hpp), then update");
  auto sent = unusual_settings();
  auto defaults = fields_of(stage_settings{});
  auto unusual = fields_of(sent);
  REQUIRE(unusual.size() == 25);
  for (const auto& [name, value] : unusual) {
    CAPTURE(name);
    CHECK(value != defaults.at(name));
  }
  CHECK(fields_of(nodes::stage_settings_from_json(nodes::to_json(sent))) == unusual);
  // Another version, a missing field and a malformed one are refused by name.
  auto j = nlohmann::json::parse(nodes::to_json(sent));
  auto refused = [](const nlohmann::json& text) {
    try {
      nodes::stage_settings_from_json(text.dump());
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  auto other = j;
  other["version"] = 99;
  CHECK(refused(other).find("settings of version 99") != std::string::npos);
  CHECK(j.at("version") == stage_settings::version);
  auto missing = j;
  missing.erase("linger");
  CHECK(refused(missing).find("field 'linger' is missing") != std::string::npos);
  auto malformed = j;
  malformed["device"] = "gpu:7";
  CHECK(refused(malformed).find("field 'device' is malformed") != std::string::npos);
}

namespace {

// Every field `visit` lists of `v`, set away from its default (each its own value), or read as
// text by name.
template <class T, class Visit>
int make_unusual(T& v, Visit visit, int n) {
  visit(v, [&](const char*, auto& value) {
    using V = std::decay_t<decltype(value)>;
    ++n;
    if constexpr (std::is_same_v<V, std::string>) {
      value = "text " + std::to_string(n);
    } else if constexpr (std::is_same_v<V, bool>) {
      value = !value;
    } else {
      value = static_cast<V>(n * 3 + 1) + static_cast<V>(std::is_floating_point_v<V> ? 0.25 : 0);
    }
  });
  return n;
}

template <class T, class Visit>
std::map<std::string, std::string> text_of(const T& v, Visit visit) {
  std::map<std::string, std::string> out;
  visit(v, [&](const char* name, const auto& value) {
    if constexpr (std::is_same_v<std::decay_t<decltype(value)>, std::string>) {
      out[name] = value;
    } else {
      out[name] = std::to_string(value);
    }
  });
  return out;
}

} // namespace

TEST_CASE("a model's options, optimizer and hooks cross to a node whole: every field, checked") {
  // A field added to one of these structs needs its line in nodes/option_fields.hpp (the
  // serializer, the parser and this test walk those lists); then update these sizes.
  static_assert(sizeof(model_options) == 80, "model_options changed: list the new field in "
                                             "visit_model_options (nodes/option_fields.hpp)");
  static_assert(sizeof(optimizer_spec) == 64, "optimizer_spec changed: list the new field in "
                                              "visit_optimizer_spec (nodes/option_fields.hpp)");
  static_assert(sizeof(hook_spec) == 96, "hook_spec changed: list the new field in "
                                         "visit_hook_spec (nodes/option_fields.hpp)");
  auto options = [](auto& o, auto&& f) { nodes::visit_model_options(o, f); };
  auto optimizer = [](auto& o, auto&& f) { nodes::visit_optimizer_spec(o, f); };
  auto hook = [](auto& h, auto&& f) { nodes::visit_hook_spec(h, f); };
  nodes::stage_spec spec;
  spec.bounds = {0, 4};
  auto& m = spec.model;
  m.name = "a model";
  m.seed = 17;
  m.loss = "cross_entropy";
  m.file = "bytes";
  m.segments = "modules:2";
  CHECK(make_unusual(m.options, options, 0) == 12);
  CHECK(make_unusual(m.optimizer, optimizer, 0) == 5);
  CHECK(make_unusual(m.hooks.after_forward, hook, 0) == 3);
  CHECK(make_unusual(m.hooks.after_backward, hook, 10) == 13);
  for (const auto& [name, value] : text_of(m.options, options)) {
    CAPTURE(name);
    CHECK(value != text_of(model_options{}, options).at(name));
  }
  auto back = nodes::stage_spec_from_json(nodes::to_json(spec)).model;
  CHECK(back.name == m.name);
  CHECK(back.seed == m.seed);
  CHECK(back.loss == m.loss);
  CHECK(back.file == m.file);
  CHECK(back.segments == m.segments);
  CHECK(text_of(back.options, options) == text_of(m.options, options));
  CHECK(text_of(back.optimizer, optimizer) == text_of(m.optimizer, optimizer));
  CHECK(text_of(back.hooks.after_forward, hook) == text_of(m.hooks.after_forward, hook));
  CHECK(text_of(back.hooks.after_backward, hook) == text_of(m.hooks.after_backward, hook));
  // A missing or malformed field is refused by name.
  auto j = nlohmann::json::parse(nodes::to_json(spec));
  auto refused = [](const nlohmann::json& text) {
    try {
      nodes::stage_spec_from_json(text.dump());
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  auto malformed = j;
  malformed["model"]["width"] = "wide";
  CHECK(refused(malformed).find("field 'width' is malformed") != std::string::npos);
  auto missing = j;
  missing["model"]["optimizer"].erase("nesterov");
  CHECK(refused(missing).find("field 'nesterov' is missing") != std::string::npos);
}

TEST_CASE("a step plan crosses to a node whole: every field it carries beside its tensors") {
  // A field added to step_plan is sent in plan_fields (nodes/protocol.cpp) or said there to stay
  // in the process; then update this size.
  static_assert(sizeof(actors::step_plan) == 168, "step_plan changed: list the new field in "
                                                  "plan_fields (nodes/protocol.cpp)");
  actors::step_plan sent;
  sent.step = 7;
  sent.train = false;
  sent.microbatches = 4;
  sent.program = {{action_kind::forward, 3, 1}, {action_kind::weight, 2, 0}};
  sent.loss_scales = {0.5, 0.25};
  sent.samples = 9;
  sent.learning_rate = 0.125;
  sent.optimistic = true;
  std::size_t targets = 0;
  auto back = nodes::step_plan_from_json(nodes::to_json(sent, 2), targets);
  CHECK(targets == 2);
  CHECK(back.step == 7);
  CHECK_FALSE(back.train);
  CHECK(back.microbatches == 4);
  CHECK((back.program == sent.program));
  CHECK(back.loss_scales == sent.loss_scales);
  CHECK(back.samples == 9);
  CHECK(back.learning_rate == 0.125);
  CHECK(back.optimistic);
  auto j = nlohmann::json::parse(nodes::to_json(sent, 2));
  j["loss_scales"] = "half";
  try {
    nodes::step_plan_from_json(j.dump(), targets);
    FAIL("a malformed plan was accepted");
  } catch (const std::exception& e) {
    CHECK(std::string(e.what()).find("field 'loss_scales' is malformed") != std::string::npos);
  }
  // An action beyond the plan's micro-batches is refused, naming both.
  auto beyond = sent;
  beyond.microbatches = 3;
  try {
    nodes::step_plan_from_json(nodes::to_json(beyond, 2), targets);
    FAIL("an action beyond the plan's micro-batches was accepted");
  } catch (const std::exception& e) {
    CHECK(std::string(e.what()).find("malformed action [0, 3, 1] (3 micro-batches)") !=
          std::string::npos);
  }
}

TEST_CASE("a node builds its stage with the settings sent, cold memory and linger included") {
  node n(node_config());
  control_client scheduler(n.address());
  scheduler.authenticate();
  nodes::stage_spec spec;
  spec.model = tiny_remote();
  spec.bounds = {0, 3, 6};
  spec.settings.index = 1;
  spec.settings.count = 2;
  spec.settings.threads = 1;
  spec.settings.warm_memory = false;
  spec.settings.linger = 0us;
  spec.settings.wait_timeout = 4321ms;
  spec.settings.recompute = recompute_mode::always;
  spec.settings.reduction = loss_reduction::sum;
  auto built = nlohmann::json::parse(scheduler.ask(nodes::build_atom::value, nodes::to_json(spec)));
  REQUIRE_MESSAGE(!built.contains("error"), built.dump());
  // What the stage actor was given, as the node reports it.
  CHECK(built.at("settings") == nlohmann::json::parse(nodes::to_json(spec.settings)));
  // A device this node does not have is refused by name.
  spec.settings.device = c10::Device(c10::kCUDA, 5);
  auto refused = scheduler.refusal<std::string>(nodes::build_atom::value, nodes::to_json(spec));
  REQUIRE(actors::is_pipeline_error(refused));
  CHECK(scheduler.render(refused).find("cuda:5") != std::string::npos);
  CHECK(actors::details_of_pipeline_error(refused).node == n.address());
}

TEST_CASE("a pipeline with a device its node does not have fails to build, naming node, stage "
          "and device") {
  node n1(node_config()), n2(node_config());
  engine sys;
  auto o = remote_options({n1.address(), n2.address()});
  o.devices = {c10::Device(c10::kCPU), c10::Device(c10::kCUDA, 3)};
  try {
    pipeline remote(sys, tiny_remote(), partition_uniform(6, 2), o);
    FAIL("the node should have refused cuda:3");
  } catch (const pipeline_error& e) {
    std::string what = e.what();
    CAPTURE(what);
    CHECK(what.find("stage 1") != std::string::npos);
    CHECK(what.find(n2.address()) != std::string::npos);
    CHECK(what.find("device cuda:3") != std::string::npos);
    // The node's refusal keeps its fields end to end.
    CHECK(e.stage() == std::optional<std::size_t>(1));
    CHECK(e.node() == n2.address());
  }
}
