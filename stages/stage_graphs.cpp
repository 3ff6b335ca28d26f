// A stage's training forward and backward through CUDA graphs (stages/graphs.hpp): the capture
// of a micro-batch's two graphs, their replays on static buffers, and the parameters'
// gradients the backward graphs add into. stages/stage.cpp decides when (the book) and runs
// everything else eagerly.
#include "stages/device.hpp"
#include "stages/stage.hpp"
#include "stages/stage_helpers.hpp"

#include <unordered_set>

#include <torch/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <actorpipe/errors.hpp>
#include <actorpipe/torch_compat.hpp>

namespace actorpipe::stages {
using namespace stage_helpers;
namespace {

// Which of `params` a backward from `roots` reaches: their gradient accumulators in the graph.
std::vector<bool> reached_from(const bundle& roots, const std::vector<torch::Tensor>& params) {
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> todo;
  for (const auto& t : roots.tensors()) {
    if (t.defined() && t.grad_fn()) {
      todo.push_back(t.grad_fn().get());
    }
  }
  while (!todo.empty()) {
    auto* node = todo.back();
    todo.pop_back();
    if (!seen.insert(node).second) {
      continue;
    }
    for (const auto& e : node->next_edges()) {
      if (e.function) {
        todo.push_back(e.function.get());
      }
    }
  }
  std::vector<bool> reached;
  for (const auto& p : params) {
    auto accumulator = torch::autograd::impl::try_get_grad_accumulator(p);
    reached.push_back(accumulator && seen.count(accumulator.get()) == 1);
  }
  return reached;
}

} // namespace

void stage::use_graphs(std::shared_ptr<device_context> device, cuda_graph_mode mode,
                       const std::string& who) {
  std::lock_guard<std::mutex> guard{mutex_};
  bool captures = device && device->captures_graphs();
  graphs_.reset(new graphs{graph_book(who, mode, captures), std::move(device), {}, {}, {}, false});
  if (!batch_norms_.empty()) {
    graphs_->book.turn_off("its deferred batch norms gather their statistics on the host");
  }
}

void stage::begin_graph_step(const std::vector<graph_action>& program) {
  std::lock_guard<std::mutex> guard{mutex_};
  if (graphs_) {
    graphs_->book.begin_step(program);
  }
}

void stage::observe_action_ms(double ms) {
  std::lock_guard<std::mutex> guard{mutex_};
  if (graphs_) {
    graphs_->book.observe(ms);
  }
}

void stage::turn_off_graphs(const std::string& why) {
  std::lock_guard<std::mutex> guard{mutex_};
  if (graphs_) {
    graphs_->book.turn_off(why);
    graphs_->passes.clear();
  }
}

bool stage::replayed_last() const {
  std::lock_guard<std::mutex> guard{mutex_};
  return graphs_ && graphs_->replayed_last;
}

std::vector<std::string> stage::take_graph_notes() {
  std::lock_guard<std::mutex> guard{mutex_};
  return graphs_ ? graphs_->book.take_notes() : std::vector<std::string>{};
}

std::pair<std::size_t, std::size_t> stage::graph_counts() const {
  std::lock_guard<std::mutex> guard{mutex_};
  return graphs_ ? std::make_pair(graphs_->book.replays(), graphs_->book.captures())
                 : std::make_pair(std::size_t{0}, std::size_t{0});
}

graph_pass& stage::capture_forward(int32_t microbatch, const bundle& x, const torch::Tensor& target,
                                   const loss_function* loss) {
  auto& g = *graphs_;
  if (!g.pool) {
    g.pool = g.device->new_graph_pool();
  }
  auto& pass = g.passes[microbatch];
  pass = graph_pass{};
  pass.input = static_copy(x);
  if (target.defined()) {
    pass.target = target.to(target.options().device(config_.device)).clone();
  }
  // The body runs at capture on a GPU (its kernels recorded, not run) and at every replay on
  // the tests' recording device: either way it leaves the outputs in the same static tensors.
  auto* p = &pass;
  std::function<void()> body;
  if (loss != nullptr) {
    body = [this, microbatch, p, loss = *loss] {
      auto value = loss_of(microbatch, run(microbatch, p->input), p->target, loss);
      p->roots = bundle(value);
      if (p->outputs.empty()) {
        p->outputs = bundle(value.detach().clone());
      } else {
        copy_into(p->outputs, bundle(value.detach()));
      }
    };
  } else {
    body = [this, microbatch, p] {
      p->roots = run(microbatch, p->input);
      if (p->outputs.empty()) {
        p->outputs = static_copy(p->roots);
      } else {
        copy_into(p->outputs, p->roots);
      }
    };
  }
  pass.forward = g.device->capture(*g.pool, body);
  return pass;
}

std::optional<bundle> stage::graphed_forward(int32_t microbatch, const bundle& x,
                                             graph_book::use use, const torch::Tensor& target,
                                             const loss_function* loss, double scale) {
  auto& g = *graphs_;
  graph_pass* pass = nullptr;
  if (use == graph_book::use::capture) {
    try {
      pass = &capture_forward(microbatch, x, target, loss);
    } catch (const std::exception& e) {
      g.passes.erase(microbatch);
      g.book.capture_failed(
        detail::concat("micro-batch ", microbatch, "'s forward: ", detail::first_line(e.what())));
      return std::nullopt;
    }
    g.book.captured(microbatch,
                    target.defined() ? tensor_signature::of(x, target) : tensor_signature::of(x));
    g.book.count_capture();
  } else {
    pass = &g.passes.at(microbatch);
    copy_into(pass->input, x);
    if (target.defined()) {
      pass->target.copy_(target, /*non_blocking=*/target.is_pinned());
    }
  }
  {
    std::shared_lock<std::shared_mutex> shared_generator(generator_lock(), std::defer_lock);
    if (draws_random_) {
      shared_generator.lock();
    }
    pass->forward->replay();
  }
  g.book.count_replay();
  g.replayed_last = true;
  stash_entry entry;
  entry.input = pass->input;
  entry.output = pass->roots;
  entry.graphed = true;
  entry.scale = scale;
  stash(microbatch, std::move(entry), 0);
  if (loss != nullptr) {
    // The loss leaves the stage as a value of its own: the graph writes the next one in place.
    return bundle(pass->outputs[0].detach().clone());
  }
  return detach_keeping_flags(pass->outputs);
}

void stage::seat_parameter_gradients(graph_pass& pass) {
  torch::NoGradGuard no_grad;
  auto params = parameters();
  auto& targets = graphs_->parameter_gradients;
  if (targets.empty()) {
    for (const auto& p : params) {
      targets.push_back(torch::zeros_like(p));
    }
  }
  for (std::size_t j = 0; j < params.size(); ++j) {
    if (!pass.reached.at(j)) {
      continue; // the graph never reaches it: its gradient stays as eager leaves it
    }
    auto& p = params[j];
    const auto& target = targets[j];
    if (!p.grad().defined()) {
      target.zero_();
    } else if (!p.grad().is_same(target)) {
      target.copy_(p.grad());
    }
    p.mutable_grad() = target;
  }
}

void stage::capture_backward(int32_t microbatch, graph_pass& pass) {
  auto& g = *graphs_;
  auto params = parameters();
  std::vector<torch::Tensor> inputs;
  for (const auto& t : pass.input.tensors()) {
    if (t.defined() && t.requires_grad()) {
      inputs.push_back(t);
    }
  }
  std::size_t n = inputs.size();
  for (const auto& p : params) {
    inputs.push_back(p);
  }
  auto* p = &pass;
  auto* targets = &g.parameter_gradients;
  auto body = [p, targets, inputs, n] {
    std::vector<torch::Tensor> roots;
    for (const auto& t : p->roots.tensors()) {
      if (t.defined() && bundle::needs_gradient(t)) {
        roots.push_back(t);
      }
    }
    compat::backward_on_this_thread here;
    auto grads = torch::autograd::grad(roots, inputs, p->gradients, /*retain_graph=*/false,
                                       /*create_graph=*/false, /*allow_unused=*/true);
    torch::NoGradGuard no_grad;
    for (std::size_t i = 0; i < n; ++i) {
      auto gi = grads[i].defined() ? grads[i] : torch::zeros_like(inputs[i]);
      if (p->input_gradients.size() <= i) {
        p->input_gradients.push_back(gi.clone());
      } else {
        p->input_gradients[i].copy_(gi);
      }
    }
    for (std::size_t j = 0; j + n < grads.size(); ++j) {
      if (p->reached[j] && grads[n + j].defined()) {
        (*targets)[j].add_(grads[n + j]);
      }
    }
  };
  try {
    pass.backward = g.device->capture(*g.pool, body);
  } catch (const std::exception& e) {
    g.book.capture_failed(
      detail::concat("micro-batch ", microbatch, "'s backward: ", detail::first_line(e.what())));
    g.passes.clear();
    throw pipeline_error(
      detail::concat(where(microbatch), ": capturing its backward as a CUDA graph failed (",
                     detail::first_line(e.what()),
                     "); this step fails and the stage runs without graphs from the next on"),
      details(microbatch, error_kind::stage_failure));
  }
  g.book.count_capture();
}

bundle stage::graphed_backward(int32_t microbatch, std::map<int32_t, stash_entry>::iterator it,
                               const bundle& output_gradient) {
  auto& entry = it->second;
  auto& pass = graphs_->passes.at(microbatch);
  bool capture = graphs_->book.backward(microbatch) == graph_book::use::capture;
  ACTORPIPE_ASSERT(capture || pass.backward);
  torch::AutoGradMode grad_mode{true};
  if (is_last()) {
    // d(scale * loss) is the loss's backward from `scale`, as eager's multiplication gives it.
    if (capture) {
      pass.gradients = {torch::full_like(pass.roots[0], entry.scale).detach()};
    } else {
      pass.gradients[0].fill_(entry.scale);
    }
  } else {
    pair_gradients(microbatch, entry, output_gradient);
    if (capture) {
      pass.gradients.clear();
      for (const auto& gr : entry.root_gradients) {
        pass.gradients.push_back(gr.detach().clone());
      }
    } else {
      torch::NoGradGuard no_grad;
      for (std::size_t k = 0; k < pass.gradients.size(); ++k) {
        pass.gradients[k].copy_(entry.root_gradients[k]);
      }
    }
  }
  if (capture) {
    pass.reached = reached_from(pass.roots, parameters());
    seat_parameter_gradients(pass);
    capture_backward(microbatch, pass);
  } else {
    seat_parameter_gradients(pass);
  }
  {
    compat::backward_on_this_thread here;
    pass.backward->replay();
  }
  graphs_->book.count_replay();
  graphs_->replayed_last = true;
  auto kept_input = entry.input;
  unstash(it);
  stash_entry view;
  view.input = std::move(kept_input);
  return input_gradients(view, pass.input_gradients);
}

} // namespace actorpipe::stages
