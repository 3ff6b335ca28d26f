#include "stages/weight_pass.hpp"

#include <actorpipe/torch_compat.hpp>

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

namespace actorpipe::stages {

using torch::autograd::Edge;
using torch::autograd::edge_list;
using torch::autograd::Node;
using torch::autograd::variable_list;

struct weight_pass::capture {
  compat::node_ref node;
  /// What B handed the node (its output gradients), kept by the hook.
  std::shared_ptr<variable_list> gradients;
  /// Its edges into B's part of the graph or to anything that is no parameter (cut for W).
  std::vector<std::size_t> cut;
};

namespace {

// Keeps the gradients a node receives; changes nothing.
class keep_gradients final : public torch::autograd::FunctionPreHook {
public:
  explicit keep_gradients(std::shared_ptr<variable_list> slot) : slot_(std::move(slot)) {}
  variable_list operator()(const variable_list& grads) override {
    *slot_ = grads;
    return grads;
  }

private:
  std::shared_ptr<variable_list> slot_;
};

// Norm layers: their weight and bias gradients reduce over what their input gradient reduces
// over anyway, so one kernel computing all three in B costs less than two passes over the
// activations (B for the input, W again for the weight and bias).
bool computes_weights_in_b(const Node& node) {
  auto name = node.name();
  return name.find("BatchNormBackward") != std::string::npos ||
         name.find("LayerNormBackward") != std::string::npos ||
         name.find("GroupNormBackward") != std::string::npos;
}

struct reach {
  // A path to one of B's inputs, to a parameter.
  bool input = false;
  bool parameter = false;
};

struct graph_reach {
  // Every node below the roots, and what it reaches (nodes that are B's inputs or a parameter's
  // accumulator are not entered).
  std::unordered_map<Node*, reach> seen;
  std::vector<Node*> roots;
};

// Depth first from the roots, iteratively (graphs of thousands of nodes are chains).
graph_reach walk_from(const std::vector<at::Tensor>& roots,
                      const std::unordered_set<const Node*>& input_nodes,
                      const std::unordered_map<const Node*, at::Tensor>& parameter_of) {
  graph_reach result;
  auto& seen = result.seen;
  std::vector<std::pair<Node*, std::size_t>> stack;
  auto terminal = [&](const Node* n, reach& into) {
    if (input_nodes.count(n) != 0) {
      into.input = true;
      return true;
    }
    if (parameter_of.count(n) != 0) {
      into.parameter = true;
      return true;
    }
    return false;
  };
  for (const auto& r : roots) {
    auto* root = r.grad_fn().get();
    if (root == nullptr) {
      continue;
    }
    result.roots.push_back(root);
    if (seen.count(root) != 0) {
      continue;
    }
    seen[root];
    stack.emplace_back(root, 0);
    while (!stack.empty()) {
      auto& [node, next] = stack.back();
      if (next < node->num_outputs()) {
        auto* child = node->next_edge(next++).function.get();
        reach ignored;
        if (child != nullptr && !terminal(child, ignored) && seen.count(child) == 0) {
          seen[child];
          stack.emplace_back(child, 0);
        }
        continue;
      }
      auto& r_node = seen[node];
      for (const auto& e : node->next_edges()) {
        auto* child = e.function.get();
        if (child == nullptr || terminal(child, r_node)) {
          continue;
        }
        const auto& c = seen.at(child);
        r_node.input = r_node.input || c.input;
        r_node.parameter = r_node.parameter || c.parameter;
      }
      stack.pop_back();
    }
  }
  return result;
}

// Every node of `seen` with an edge to each parameter's accumulator.
std::unordered_map<const Node*, std::vector<const Node*>>
users_of_parameters(const std::unordered_map<Node*, reach>& seen,
                    const std::unordered_map<const Node*, at::Tensor>& parameter_of) {
  std::unordered_map<const Node*, std::vector<const Node*>> users;
  for (const auto& [node, r] : seen) {
    for (const auto& e : node->next_edges()) {
      if (e.function && parameter_of.count(e.function.get()) != 0) {
        users[e.function.get()].push_back(node);
      }
    }
  }
  return users;
}

// The nodes B's inputs' gradients end in.
std::unordered_set<const Node*> input_nodes_of(const std::vector<at::Tensor>& inputs) {
  std::unordered_set<const Node*> nodes;
  for (const auto& x : inputs) {
    if (auto node = torch::autograd::impl::gradient_edge(x).function) {
      nodes.insert(node.get());
    }
  }
  return nodes;
}

// Each parameter's gradient accumulator (the node its gradient ends in).
std::unordered_map<const Node*, at::Tensor>
accumulators_of(const std::vector<at::Tensor>& parameters) {
  std::unordered_map<const Node*, at::Tensor> parameter_of;
  for (const auto& p : parameters) {
    if (p.requires_grad()) {
      if (auto node = torch::autograd::impl::try_get_grad_accumulator(p)) {
        parameter_of.emplace(node.get(), p);
      }
    }
  }
  return parameter_of;
}

// What a node on the input path sends towards weights: whether it does, whether only to
// parameters no other node uses (a norm's weight and bias), and the edges B keeps (`cut`: the
// others, towards weights, are W's).
struct weight_edges {
  bool weights = false;
  bool own_parameters_only = true;
  std::vector<std::size_t> cut;
};

weight_edges weight_edges_of(Node* node, const graph_reach& graph,
                             const std::unordered_set<const Node*>& input_nodes,
                             const std::unordered_map<const Node*, at::Tensor>& parameter_of,
                             std::unordered_map<const Node*, std::vector<const Node*>>& users) {
  weight_edges edges;
  for (std::size_t i = 0; i < node->num_outputs(); ++i) {
    auto* child = node->next_edge(i).function.get();
    if (child == nullptr) {
      continue;
    }
    bool to_parameters = parameter_of.count(child) != 0;
    edges.own_parameters_only =
      edges.own_parameters_only && (!to_parameters || users[child].size() == 1);
    if (!to_parameters && input_nodes.count(child) == 0) {
      // Off the input path towards parameters (a weight's transpose in a linear, a weight
      // computed from a parameter): B never runs it, W runs it once, as a walk would.
      const auto& c = graph.seen.at(child);
      to_parameters = !c.input && c.parameter;
      edges.own_parameters_only = edges.own_parameters_only && !to_parameters;
    }
    if (to_parameters) {
      edges.weights = true;
    } else {
      edges.cut.push_back(i);
    }
  }
  return edges;
}

} // namespace

weight_pass::weight_pass() = default;
weight_pass::~weight_pass() = default;

std::shared_ptr<weight_pass> weight_pass::prepare(const std::vector<at::Tensor>& roots,
                                                  const std::vector<at::Tensor>& inputs,
                                                  const std::vector<at::Tensor>& parameters) {
  auto input_nodes = input_nodes_of(inputs);
  auto parameter_of = accumulators_of(parameters);
  if (input_nodes.empty()) {
    return nullptr;
  }
  auto graph = walk_from(roots, input_nodes, parameter_of);
  // Hooks go on only once the whole graph is known to be covered.
  for (auto* root : graph.roots) {
    const auto& r = graph.seen.at(root);
    if (r.parameter && !r.input) {
      return nullptr; // an output computed from parameters alone
    }
  }
  std::shared_ptr<weight_pass> pass(new weight_pass());
  auto users = users_of_parameters(graph.seen, parameter_of);
  for (auto& [node, r] : graph.seen) {
    if (!r.input) {
      continue;
    }
    auto edges = weight_edges_of(node, graph, input_nodes, parameter_of, users);
    if (!edges.weights) {
      continue;
    }
    if (edges.own_parameters_only && computes_weights_in_b(*node)) {
      for (const auto& e : node->next_edges()) {
        if (e.function && parameter_of.count(e.function.get()) != 0) {
          pass->in_b_.push_back(parameter_of.at(e.function.get()));
        }
      }
      continue;
    }
    auto slot = std::make_shared<variable_list>();
    pass->captures_.push_back(capture{compat::hold(*node), slot, std::move(edges.cut)});
  }
  for (auto& c : pass->captures_) {
    c.node->add_pre_hook(std::make_unique<keep_gradients>(c.gradients));
  }
  return pass;
}

std::vector<at::Tensor> input_backward(const std::vector<at::Tensor>& roots,
                                       const std::vector<at::Tensor>& inputs,
                                       const std::vector<at::Tensor>& root_gradients,
                                       const weight_pass* pass) {
  auto targets = inputs;
  if (pass != nullptr) {
    targets.insert(targets.end(), pass->in_b_.begin(), pass->in_b_.end());
  }
  compat::backward_on_this_thread here;
  auto grads = torch::autograd::grad(roots, targets, root_gradients, /*retain_graph=*/true,
                                     /*create_graph=*/false, /*allow_unused=*/true);
  if (pass != nullptr) {
    torch::NoGradGuard no_grad;
    for (std::size_t k = 0; k < pass->in_b_.size(); ++k) {
      const auto& g = grads[inputs.size() + k];
      if (!g.defined()) {
        continue;
      }
      auto p = pass->in_b_[k];
      if (p.grad().defined()) {
        p.mutable_grad().add_(g);
      } else {
        p.mutable_grad() = g.detach().clone();
      }
    }
  }
  grads.resize(inputs.size());
  return grads;
}

bool weight_backward(const std::vector<at::Tensor>& roots,
                     const std::vector<at::Tensor>& root_gradients,
                     const std::vector<at::Tensor>& parameters, weight_pass* pass) {
  if (pass != nullptr && pass->complete()) {
    pass->run();
    return true;
  }
  auto targets = pass != nullptr ? pass->left_for_w(parameters) : parameters;
  if (!targets.empty()) {
    compat::backward_on_this_thread here;
    torch::autograd::backward(roots, root_gradients, /*retain_graph=*/false,
                              /*create_graph=*/false, /*inputs=*/targets);
  }
  return false;
}

std::vector<at::Tensor> weight_pass::left_for_w(const std::vector<at::Tensor>& parameters) const {
  std::vector<at::Tensor> left;
  for (const auto& p : parameters) {
    bool in_b =
      std::any_of(in_b_.begin(), in_b_.end(), [&](const at::Tensor& q) { return q.is_same(p); });
    if (!in_b) {
      left.push_back(p);
    }
  }
  return left;
}

int64_t weight_pass::kept_bytes() const {
  int64_t bytes = 0;
  for (const auto& c : captures_) {
    for (const auto& g : *c.gradients) {
      if (g.defined()) {
        bytes += static_cast<int64_t>(g.numel() * g.element_size());
      }
    }
  }
  return bytes;
}

bool weight_pass::complete() const {
  for (const auto& c : captures_) {
    if (c.gradients->empty()) {
      return false;
    }
  }
  return true;
}

void weight_pass::run() {
  if (ran_) {
    return;
  }
  ran_ = true;
  // Each weight node keeps only its edges towards parameters: it computes those gradients alone
  // (a node computes an output only for a valid edge), and the engine walks on only into what
  // B never ran (a weight's transpose) down to the parameters. B is done, so the graph's other
  // edges are no longer needed.
  edge_list roots;
  variable_list gradients;
  for (auto& c : captures_) {
    for (auto i : c.cut) {
      c.node->next_edges()[i] = Edge();
    }
    for (std::size_t k = 0; k < c.gradients->size(); ++k) {
      const auto& g = (*c.gradients)[k];
      if (g.defined()) {
        roots.emplace_back(c.node, static_cast<uint32_t>(k));
        gradients.push_back(g);
      }
    }
    c.gradients->clear();
  }
  if (roots.empty()) {
    return;
  }
  compat::backward_on_this_thread here;
  torch::autograd::Engine::get_default_engine().execute(roots, gradients, /*keep_graph=*/false,
                                                        /*create_graph=*/false,
                                                        /*accumulate_grad=*/true);
}

} // namespace actorpipe::stages
