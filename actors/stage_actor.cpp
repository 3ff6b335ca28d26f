#include "actors/stage_actor.hpp"

#include <map>
#include <utility>

#include <ATen/Parallel.h>
#include <caf/all.hpp>

#include "actors/messages.hpp"
#include "stages/stage.hpp"

namespace actorpipe::actors {
namespace {

using clock_type = std::chrono::steady_clock;
using key = std::pair<uint64_t, int32_t>;

double ms_since(clock_type::time_point start) {
  return std::chrono::duration<double, std::milli>(clock_type::now() - start).count();
}

struct stage_state {
  std::shared_ptr<stages::stage> stage;
  stage_actor_options options;
  caf::actor scheduler;
  caf::actor prev;
  caf::actor next;
  bool threads_set = false;

  // Inputs that arrived for a step, keyed by (step, micro-batch).
  std::map<key, torch::Tensor> activations;
  std::map<key, torch::Tensor> gradients;

  // The running step.
  bool active = false;
  step_plan plan;
  std::size_t pc = 0;
  stage_report report;
  // Bumped whenever the program moves; a deadline timer only fires for the token it was set for.
  uint64_t wait_token = 0;
  bool waiting = false;
  clock_type::time_point wait_start;

  static inline const char* name = "actorpipe.stage";
};

using stage_actor_type = caf::stateful_actor<stage_state>;

void drop_older_than(std::map<key, torch::Tensor>& inputs, uint64_t step) {
  inputs.erase(inputs.begin(), inputs.lower_bound(key{step, INT32_MIN}));
}

void drop_step(std::map<key, torch::Tensor>& inputs, uint64_t step) {
  inputs.erase(inputs.lower_bound(key{step, INT32_MIN}), inputs.upper_bound(key{step, INT32_MAX}));
}

void fail(stage_actor_type* self, const std::string& message) {
  auto& s = self->state;
  s.active = false;
  s.stage->abort_step();
  drop_step(s.activations, s.plan.step);
  drop_step(s.gradients, s.plan.step);
  self->send(s.scheduler, failed_atom::value, s.plan.step, message);
}

std::string describe_wait(const stage_state& s, const action& a) {
  auto index = s.stage->config().index;
  if (a.kind == action_kind::forward) {
    return detail::concat("stage ", index, " waits for the activation of microbatch ", a.microbatch,
                          " from stage ", index - 1);
  }
  return detail::concat("stage ", index, " waits for the gradient of microbatch ", a.microbatch,
                        " from stage ", index + 1);
}

// Runs the program as far as its inputs allow.
void advance(stage_actor_type* self) {
  auto& s = self->state;
  auto& st = *s.stage;
  if (s.waiting) {
    s.report.stats.wait_ms += ms_since(s.wait_start);
    s.waiting = false;
  }
  while (s.active && s.pc < s.plan.program.size()) {
    const auto a = s.plan.program[s.pc];
    const key k{s.plan.step, a.microbatch};
    bool forward = a.kind == action_kind::forward;
    bool has_input =
      forward ? s.activations.count(k) == 1 : st.is_last() || s.gradients.count(k) == 1;
    if (!has_input) {
      s.waiting = true;
      s.wait_start = clock_type::now();
      self->delayed_send(self, s.options.wait_timeout, timeout_atom::value, s.plan.step,
                         s.wait_token);
      return;
    }
    auto start = clock_type::now();
    try {
      if (forward) {
        auto input = std::move(s.activations[k]);
        s.activations.erase(k);
        if (s.plan.train && st.is_last()) {
          auto mb = static_cast<std::size_t>(a.microbatch);
          auto value = st.forward_loss(a.microbatch, input, s.plan.targets.at(mb), s.options.loss,
                                       s.plan.loss_scales.at(mb));
          s.report.loss += s.plan.loss_scales.at(mb) * value;
        } else {
          auto output = st.forward(a.microbatch, input);
          if (st.is_last()) {
            s.report.outputs.at(static_cast<std::size_t>(a.microbatch)) = std::move(output);
          } else {
            self->send(s.next, forward_atom::value, s.plan.step, a.microbatch, std::move(output));
          }
        }
        s.report.stats.forward_ms += ms_since(start);
      } else {
        torch::Tensor grad;
        if (!st.is_last()) {
          grad = std::move(s.gradients[k]);
          s.gradients.erase(k);
        }
        auto input_grad = st.backward(a.microbatch, grad);
        if (!st.is_first()) {
          self->send(s.prev, backward_atom::value, s.plan.step, a.microbatch,
                     std::move(input_grad));
        }
        s.report.stats.backward_ms += ms_since(start);
      }
    } catch (const std::exception& e) {
      fail(self, e.what());
      return;
    }
    ++s.pc;
    ++s.wait_token;
  }
  if (s.active) {
    s.active = false;
    s.report.stats.peak_stash = st.peak_stash();
    self->send(s.scheduler, done_atom::value, std::move(s.report));
  }
}

void set_threads(stage_state& s) {
  if (!s.threads_set) {
    // With OpenMP this sets the calling (stage) thread's team size.
    at::set_num_threads(static_cast<int>(s.options.threads));
    s.threads_set = true;
  }
}

caf::behavior stage_actor(stage_actor_type* self, std::shared_ptr<stages::stage> stage,
                          caf::actor scheduler, stage_actor_options options) {
  self->state.stage = std::move(stage);
  self->state.scheduler = std::move(scheduler);
  self->state.options = std::move(options);
  return {
    [=](connect_atom, caf::actor prev, caf::actor next) {
      self->state.prev = std::move(prev);
      self->state.next = std::move(next);
    },
    [=](plan_atom, step_plan& plan) {
      auto& s = self->state;
      set_threads(s);
      auto& st = *s.stage;
      drop_older_than(s.activations, plan.step);
      drop_older_than(s.gradients, plan.step);
      s.report = stage_report{};
      s.report.step = plan.step;
      s.report.stats.stage = st.config().index;
      if (st.is_last() && !plan.train) {
        s.report.outputs.resize(plan.program.size());
      }
      for (std::size_t mb = 0; mb < plan.inputs.size(); ++mb) {
        s.activations[key{plan.step, static_cast<int32_t>(mb)}] = std::move(plan.inputs[mb]);
      }
      plan.inputs.clear();
      s.plan = std::move(plan);
      s.pc = 0;
      ++s.wait_token;
      s.waiting = false;
      s.active = true;
      try {
        st.begin_step(s.plan.train);
      } catch (const std::exception& e) {
        fail(self, e.what());
        return;
      }
      advance(self);
    },
    [=](forward_atom, uint64_t step, int32_t microbatch, torch::Tensor& x) {
      auto& s = self->state;
      if (step < s.plan.step || (step == s.plan.step && !s.active && s.pc > 0)) {
        return; // an aborted or finished step
      }
      s.activations[key{step, microbatch}] = std::move(x);
      if (s.active && step == s.plan.step) {
        advance(self);
      }
    },
    [=](backward_atom, uint64_t step, int32_t microbatch, torch::Tensor& g) {
      auto& s = self->state;
      if (step < s.plan.step || (step == s.plan.step && !s.active && s.pc > 0)) {
        return;
      }
      s.gradients[key{step, microbatch}] = std::move(g);
      if (s.active && step == s.plan.step) {
        advance(self);
      }
    },
    [=](timeout_atom, uint64_t step, uint64_t token) {
      auto& s = self->state;
      if (!s.active || step != s.plan.step || token != s.wait_token || !s.waiting) {
        return;
      }
      const auto& a = s.plan.program[s.pc];
      fail(self, detail::concat(describe_wait(s, a), " (step ", step, ", action ", s.pc,
                                " of its program) and gave up after ",
                                s.options.wait_timeout.count(), " ms"));
    },
    [=](abort_atom, uint64_t step) {
      auto& s = self->state;
      drop_step(s.activations, step);
      drop_step(s.gradients, step);
      if (step == s.plan.step) {
        s.active = false;
        s.stage->abort_step();
      }
      return true;
    },
    [=](update_atom, uint64_t step, double learning_rate) -> caf::result<double, std::string> {
      auto start = clock_type::now();
      try {
        if (learning_rate >= 0) {
          self->state.stage->set_learning_rate(learning_rate);
        }
        self->state.stage->optimizer_step();
      } catch (const std::exception& e) {
        return {ms_since(start),
                detail::concat("stage ", self->state.stage->config().index, ", step ", step,
                               ": optimizer step failed: ", e.what())};
      }
      return {ms_since(start), std::string{}};
    },
    [=](save_atom, const std::string& path) -> std::string {
      try {
        stages::save_tensors(path, self->state.stage->state());
      } catch (const std::exception& e) {
        return detail::concat("stage ", self->state.stage->config().index, ": ", e.what());
      }
      return {};
    },
    [=](load_atom, const std::shared_ptr<const tensor_map>& all) -> std::string {
      try {
        self->state.stage->load_state(*all);
      } catch (const std::exception& e) {
        return e.what();
      }
      return {};
    },
  };
}

} // namespace

caf::actor spawn_stage(caf::actor_system& sys, std::shared_ptr<stages::stage> stage,
                       caf::actor scheduler, stage_actor_options options) {
  return sys.spawn<caf::detached>(stage_actor, std::move(stage), std::move(scheduler),
                                  std::move(options));
}

} // namespace actorpipe::actors
