// Where an exported program is cut, and each segment's live values (exported_segments.hpp).
#include "models/exported_segments.hpp"

#include <algorithm>
#include <map>
#include <tuple>

#include <actorpipe/errors.hpp>

namespace actorpipe::exported {

namespace {

using detail::concat;

struct span {
  std::string name;
  std::size_t begin, end;
};

// Segments by submodule `depth` deep: a node of an enclosing module (or of the model's own
// forward) joins the segment before it, those before the first submodule the one after.
std::vector<span> by_module(const program& p, std::size_t depth) {
  std::vector<span> spans;
  std::map<std::string, int> seen;
  std::string current;
  for (std::size_t i = 0; i < p.nodes.size(); ++i) {
    const auto& modules = p.nodes[i].modules;
    if (modules.size() < depth) {
      continue; // joins the segment it stands in
    }
    const auto& key = modules[depth - 1];
    if (!spans.empty() && key == current) {
      continue;
    }
    auto times = ++seen[key];
    current = key;
    spans.push_back({times == 1 ? key : concat(key, "#", times), spans.empty() ? 0 : i, 0});
  }
  if (spans.empty()) {
    return {{"model", 0, p.nodes.size()}};
  }
  for (std::size_t k = 0; k + 1 < spans.size(); ++k) {
    spans[k].end = spans[k + 1].begin;
  }
  spans.back().end = p.nodes.size();
  return spans;
}

// --- blocks ---------------------------------------------------------------------------------
// A library's model nests its repeated blocks under wrappers (Wrapper.model.model.layers.N,
// layer3.1, encoder.layers.encoder_layer_4): siblings of one class. The blocks are the group of
// same-class siblings that scores highest by members times the parameters they hold (so that
// seventeen inverted residuals beat a features-and-classifier pair, and four decoder layers the
// four projections inside one); a container block (an nn.Sequential stage of a ResNet) whose
// children all share one class is cut at them. What runs before the first block and after the
// last are a segment each; nodes between two blocks join the one before.

bool within(const std::string& path, const std::string& module) {
  return path.size() >= module.size() && path.compare(0, module.size(), module) == 0 &&
         (path.size() == module.size() || path[module.size()] == '.');
}

std::string parent_of(const std::string& path) {
  auto dot = path.rfind('.');
  return dot == std::string::npos ? std::string() : path.substr(0, dot);
}

bool is_container(const std::string& type) {
  static const std::set<std::string> containers{"torch.nn.modules.container.Sequential",
                                                "torch.nn.modules.container.ModuleList",
                                                "torch.nn.modules.container.ModuleDict"};
  return containers.count(type) != 0;
}

struct module_seen {
  std::string path, type;
  int64_t parameters = 0;
};

// Every module the nodes ran in, in the order they first ran, with the parameters it holds.
struct modules_run {
  std::vector<module_seen> seen;
  std::map<std::string, std::size_t> at; // path -> its place in `seen`

  const module_seen* find(const std::string& path) const {
    auto it = at.find(path);
    return it == at.end() ? nullptr : &seen[it->second];
  }
};

modules_run modules_of(const program& p) {
  modules_run run;
  for (const auto& n : p.nodes) {
    for (std::size_t k = 0; k < n.modules.size(); ++k) {
      if (run.at.emplace(n.modules[k], run.seen.size()).second) {
        run.seen.push_back({n.modules[k], n.module_types[k], 0});
      }
    }
  }
  // A parameter counts for its module and every module above it.
  for (const auto& s : p.state) {
    for (auto owner = parent_of(s.name); s.role == state_tensor::kind::parameter && !owner.empty();
         owner = parent_of(owner)) {
      if (auto it = run.at.find(owner); it != run.at.end()) {
        run.seen[it->second].parameters += s.tensor.numel();
      }
    }
  }
  return run;
}

// A container block whose children all share one class is cut at them (a ResNet's stages at
// their blocks), again until none is.
void cut_containers(const modules_run& run, std::set<std::string>& blocks) {
  for (bool cut = true; cut;) {
    cut = false;
    for (const auto& b : std::set<std::string>(blocks)) {
      std::vector<const module_seen*> children;
      for (const auto& m : run.seen) {
        if (parent_of(m.path) == b) {
          children.push_back(&m);
        }
      }
      bool alike = is_container(run.find(b)->type) && children.size() >= 2 &&
                   std::all_of(children.begin(), children.end(),
                               [&](const module_seen* c) { return c->type == children[0]->type; });
      if (alike) {
        blocks.erase(b);
        for (const auto* c : children) {
          blocks.insert(c->path);
        }
        cut = true;
      }
    }
  }
}

// The modules that are the blocks, or none.
std::set<std::string> blocks_of(const modules_run& run) {
  const auto& seen = run.seen;
  std::map<std::pair<std::string, std::string>, std::vector<const module_seen*>> groups;
  for (const auto& m : seen) {
    groups[{parent_of(m.path), m.type}].push_back(&m);
  }
  // Members times parameters; then a class of its own over a container, the shallower group,
  // the first seen.
  auto rank = [](const std::vector<const module_seen*>& g) {
    double sum = 0;
    for (const auto* m : g) {
      sum += static_cast<double>(m->parameters);
    }
    auto depth = std::count(g.front()->path.begin(), g.front()->path.end(), '.');
    return std::make_tuple(sum * static_cast<double>(g.size()), !is_container(g.front()->type),
                           -depth);
  };
  const std::vector<const module_seen*>* best = nullptr;
  for (const auto& [key, members] : groups) {
    if (members.size() >= 2 && std::get<0>(rank(members)) > 0 &&
        (best == nullptr || rank(members) > rank(*best))) {
      best = &members;
    }
  }
  std::set<std::string> blocks;
  if (best == nullptr) {
    return blocks;
  }
  for (const auto* m : *best) {
    blocks.insert(m->path);
  }
  cut_containers(run, blocks);
  return blocks;
}

// The block node `n` runs in ("" outside every block).
std::string block_of(const node& n, const std::set<std::string>& blocks) {
  for (const auto& m : n.modules) {
    if (blocks.count(m) != 0) {
      return m;
    }
  }
  return {};
}

// A segment before or after the blocks, named by the modules in it that hold parameters (else
// by all of them) other than the blocks' enclosing modules: "model.model.embed_tokens",
// "model.model.norm+model.lm_head"; `fallback` where it runs in none.
std::string region_name(const program& p, std::size_t begin, std::size_t end,
                        const std::set<std::string>& blocks, const modules_run& run,
                        const std::string& fallback) {
  std::vector<std::string> all, holding;
  for (std::size_t i = begin; i < end; ++i) {
    for (const auto& m : p.nodes[i].modules) {
      bool encloses = std::any_of(blocks.begin(), blocks.end(),
                                  [&](const std::string& b) { return within(b, m); });
      if (encloses) {
        continue;
      }
      if (std::find(all.begin(), all.end(), m) == all.end()) {
        all.push_back(m);
        if (run.find(m)->parameters > 0) {
          holding.push_back(m);
        }
      }
      break;
    }
  }
  const auto& names = holding.empty() ? all : holding;
  std::string name;
  for (std::size_t k = 0; k < names.size() && k < 3; ++k) {
    name += (k == 0 ? "" : "+") + names[k];
  }
  return name.empty() ? fallback : names.size() > 3 ? name + "+..." : name;
}

std::vector<span> by_blocks(const program& p) {
  auto run = modules_of(p);
  auto blocks = blocks_of(run);
  if (blocks.empty()) {
    return {};
  }
  std::vector<span> spans;
  std::map<std::string, int> times;
  std::string current;
  std::size_t last = 0; // the last node in a block
  for (std::size_t i = 0; i < p.nodes.size(); ++i) {
    auto b = block_of(p.nodes[i], blocks);
    if (b.empty()) {
      continue;
    }
    last = i;
    if (!spans.empty() && b == current) {
      continue;
    }
    auto k = ++times[b];
    current = b;
    spans.push_back({k == 1 ? b : concat(b, "#", k), i, 0});
  }
  for (std::size_t k = 0; k + 1 < spans.size(); ++k) {
    spans[k].end = spans[k + 1].begin;
  }
  spans.back().end = last + 1;
  auto runs_in_a_module = [&](std::size_t begin, std::size_t end) {
    for (std::size_t i = begin; i < end; ++i) {
      if (!p.nodes[i].modules.empty()) {
        return true;
      }
    }
    return false;
  };
  if (runs_in_a_module(last + 1, p.nodes.size())) {
    spans.push_back(
      {region_name(p, last + 1, p.nodes.size(), blocks, run, "output"), last + 1, p.nodes.size()});
  } else {
    spans.back().end = p.nodes.size();
  }
  auto first = spans.front().begin;
  if (runs_in_a_module(0, first)) {
    spans.insert(spans.begin(), {region_name(p, 0, first, blocks, run, "input"), 0, first});
  } else {
    spans.front().begin = 0;
  }
  return spans;
}

std::vector<span> by_marker(const program& p) {
  std::vector<span> spans;
  std::size_t begin = 0;
  auto cut_at = p.markers;
  cut_at.push_back(p.nodes.size());
  for (auto at : cut_at) {
    if (at > begin) {
      spans.push_back({concat("part", spans.size()), begin, at});
      begin = at;
    }
  }
  return spans;
}

// "auto" without markers: at the blocks where the model repeats them, else by top-level
// submodule, or, where the model wraps everything in one (self.body = nn.Sequential(...)), by the
// first depth that gives more than one segment.
std::vector<span> without_markers(const program& p) {
  auto spans = by_blocks(p);
  if (spans.size() >= 2) {
    return spans;
  }
  std::size_t deepest = 1;
  for (const auto& n : p.nodes) {
    deepest = std::max(deepest, n.modules.size());
  }
  spans = by_module(p, 1);
  for (std::size_t depth = 2; spans.size() < 2 && depth <= deepest; ++depth) {
    spans = by_module(p, depth);
  }
  return spans;
}

std::vector<span> spans_of(const program& p, const std::string& how) {
  if (how == "auto") {
    return p.markers.empty() ? without_markers(p) : by_marker(p);
  }
  if (how == "markers") {
    ACTORPIPE_CHECK(!p.markers.empty(), p.what,
                    ": --segments markers, but the program has no "
                    "pipe_split() marker (call torch.distributed.pipelining.pipe_split() in "
                    "forward before export)");
    return by_marker(p);
  }
  if (how == "modules") {
    return by_module(p, 1);
  }
  if (how == "blocks") {
    auto spans = by_blocks(p);
    ACTORPIPE_CHECK(!spans.empty(), p.what,
                    ": --segments blocks, but the model has no repeated blocks (no two "
                    "submodules of one class under one parent hold parameters); use modules, "
                    "modules:K or nodes");
    return spans;
  }
  if (how.rfind("modules:", 0) == 0) {
    int depth = 0;
    try {
      depth = std::stoi(how.substr(8));
    } catch (const std::exception&) {
    }
    ACTORPIPE_CHECK(depth >= 1, "segments '", how, "': the depth after 'modules:' is a count >= 1");
    return by_module(p, static_cast<std::size_t>(depth));
  }
  if (how == "nodes") {
    std::vector<span> spans;
    for (std::size_t i = 0; i < p.nodes.size(); ++i) {
      spans.push_back({p.nodes[i].name, i, i + 1});
    }
    return spans;
  }
  throw invalid_argument(concat("segments '", how,
                                "' is not auto, blocks, modules, modules:K, "
                                "markers or nodes"));
}

// Where each value is defined (-1: an input or state) and last used (nodes.size(): returned).
struct liveness {
  std::vector<long> defined, last_use;
  std::vector<bool> state;

  explicit liveness(const program& p)
    : defined(p.values.size(), -1), last_use(p.values.size(), -1), state(p.values.size(), false) {
    for (const auto& s : p.state) {
      for (auto v : s.slots) {
        state[static_cast<std::size_t>(v)] = true;
      }
    }
    for (std::size_t i = 0; i < p.nodes.size(); ++i) {
      for (const auto& a : p.nodes[i].arguments) {
        use(a.value, i);
        for (auto v : a.values) {
          use(v, i);
        }
      }
      for (const auto& o : p.nodes[i].outputs) {
        define(o.value, i);
        for (auto v : o.values) {
          define(v, i);
        }
      }
    }
    for (auto v : p.user_outputs) {
      use(v, p.nodes.size());
    }
    // A buffer's new value (a functional graph's) is written back by the segment that makes
    // it: it does not travel.
  }

  void use(slot v, std::size_t i) {
    if (v >= 0) {
      auto& last = last_use[static_cast<std::size_t>(v)];
      last = std::max(last, static_cast<long>(i));
    }
  }
  void define(slot v, std::size_t i) {
    if (v >= 0) {
      defined[static_cast<std::size_t>(v)] = static_cast<long>(i);
    }
  }

  // Values made before node `at` (or given) and needed at or after it; state excluded.
  std::vector<slot> live_at(std::size_t at) const {
    std::vector<slot> live;
    for (std::size_t v = 0; v < defined.size(); ++v) {
      if (!state[v] && defined[v] < static_cast<long>(at) && last_use[v] >= static_cast<long>(at)) {
        live.push_back(static_cast<slot>(v));
      }
    }
    return live;
  }
};

// The state the segment reads, registered or borrowed; what no node reads is kept by the first
// segment (its state, checkpointed all the same).
void assign_state(const program& p, const std::set<slot>& read_anywhere, segment_plan& plan,
                  std::vector<bool>& buffer_taken) {
  std::set<slot> read;
  for (std::size_t i = plan.begin; i < plan.end; ++i) {
    for (const auto& a : p.nodes[i].arguments) {
      read.insert(a.value);
      read.insert(a.values.begin(), a.values.end());
    }
  }
  for (std::size_t k = 0; k < p.state.size(); ++k) {
    const auto& s = p.state[k];
    bool used =
      std::any_of(s.slots.begin(), s.slots.end(), [&](slot v) { return read.count(v) != 0; });
    bool unread = std::none_of(s.slots.begin(), s.slots.end(),
                               [&](slot v) { return read_anywhere.count(v) != 0; });
    if (!used && !(unread && plan.first)) {
      continue;
    }
    bool owned = s.role == state_tensor::kind::parameter ||
                 (s.role == state_tensor::kind::buffer && s.persistent && !buffer_taken[k]);
    if (owned && s.role == state_tensor::kind::buffer) {
      buffer_taken[k] = true;
    }
    (owned ? plan.registered : plan.borrowed).push_back(k);
  }
}

segment_plan plan_of(const program& p, const liveness& live, const span& s, bool first, bool last) {
  segment_plan plan;
  plan.name = s.name;
  plan.begin = s.begin;
  plan.end = s.end;
  plan.first = first;
  plan.last = last;
  plan.inputs = first ? p.user_inputs : live.live_at(s.begin);
  plan.outputs = last ? p.user_outputs : live.live_at(s.end);
  std::set<slot> kept(plan.outputs.begin(), plan.outputs.end());
  for (const auto& m : p.mutations) {
    auto d = live.defined[static_cast<std::size_t>(m.first)];
    if (d >= static_cast<long>(s.begin) && d < static_cast<long>(s.end)) {
      plan.mutations.push_back(m);
      kept.insert(m.first);
    }
  }
  plan.drop.assign(s.end, {});
  for (std::size_t i = s.begin; i < s.end; ++i) {
    const auto& n = p.nodes[i];
    plan.draws_random = plan.draws_random || n.draws_random;
    for (auto v : n.writes) {
      if (std::find(plan.inputs.begin(), plan.inputs.end(), v) != plan.inputs.end()) {
        plan.written_inputs.insert(v);
      }
    }
  }
  for (std::size_t v = 0; v < live.defined.size(); ++v) {
    if (live.state[v] || kept.count(static_cast<slot>(v)) != 0) {
      continue;
    }
    auto last_use = live.last_use[v];
    auto defined = live.defined[v];
    auto here = [&](long i) {
      return i >= static_cast<long>(s.begin) && i < static_cast<long>(s.end);
    };
    // Dropped after its last use here, or at once when nothing uses what a node here made.
    long at = here(last_use) ? last_use : (here(defined) && last_use < defined) ? defined : -1;
    if (at >= 0) {
      plan.drop[static_cast<std::size_t>(at)].push_back(static_cast<slot>(v));
    }
  }
  return plan;
}

} // namespace

std::vector<const state_tensor*> saved_state(const program& p) {
  std::vector<const state_tensor*> out;
  for (const auto& s : p.state) {
    if (s.role != state_tensor::kind::constant && s.persistent) {
      out.push_back(&s);
    }
  }
  return out;
}

std::vector<segment_plan> plan_segments(const program& p, const exported_options& options) {
  ACTORPIPE_CHECK(!p.nodes.empty(), p.what, ": the program has no nodes to run");
  auto spans = spans_of(p, options.segments);
  liveness live(p);
  std::vector<segment_plan> plans;
  std::vector<bool> buffer_taken(p.state.size(), false);
  std::set<slot> read_anywhere;
  for (const auto& n : p.nodes) {
    for (const auto& a : n.arguments) {
      read_anywhere.insert(a.value);
      read_anywhere.insert(a.values.begin(), a.values.end());
    }
  }
  for (std::size_t k = 0; k < spans.size(); ++k) {
    plans.push_back(plan_of(p, live, spans[k], k == 0, k + 1 == spans.size()));
    assign_state(p, read_anywhere, plans.back(), buffer_taken);
  }
  return plans;
}

} // namespace actorpipe::exported
