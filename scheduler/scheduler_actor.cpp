#include "scheduler/scheduler_actor.hpp"

#include <algorithm>
#include <cmath>
#include <deque>
#include <map>
#include <optional>

#include <caf/all.hpp>

#include "actors/deadline.hpp"
#include "actors/linger.hpp"
#include "actors/messages.hpp"
#include "actors/request_error.hpp"
#include "logging/log.hpp"
#include "stages/checkpoint.hpp"

namespace actorpipe::scheduler {
namespace {

using namespace actorpipe::actors;
using clock_type = std::chrono::steady_clock;
using step_timeout_atom = caf::atom_constant<caf::atom("steptime")>;

struct scheduler_state {
  scheduler_options options;
  std::vector<stage_actor> stages;
  std::deque<std::shared_ptr<step_request>> queue;
  // A stage actor that terminated makes every later step fail at once with this failure.
  std::optional<failure> broken;

  std::shared_ptr<step_request> current;
  uint64_t step = 0;
  clock_type::time_point started;
  std::vector<stage_report> reports;
  std::size_t reported = 0;
  std::size_t updated = 0;
  double grad_norm = 0;
  // The stage that reported last in the previous training step (none yet: every stage).
  std::size_t last_reporter = SIZE_MAX;
  // Whether clipping scaled the previous training step's gradients.
  bool last_clipped = false;
  bool aborting = false;
  failure abort_failure;
  std::size_t aborts_pending = 0;
  std::map<std::pair<std::size_t, bool>, schedule> schedules;
  // Overlapping steps: the training step after the running one, whose plans the stages have
  // already (numbered step + 1), with the reports and the failure that came for it meanwhile.
  struct ahead_step {
    std::shared_ptr<step_request> request;
    clock_type::time_point started;
    std::vector<stage_report> reports;
    std::size_t reported = 0;
    std::optional<failure> failed;
  };
  std::optional<ahead_step> ahead;
  // The running step's deadline (one timer at most pending: actors/deadline.hpp).
  deadline_timer deadline;

  static inline const char* name = "actorpipe.scheduler";
};

/// The scheduler protocol plus the step deadline the scheduler sets itself.
using scheduler_self_actor = scheduler_actor::extend<caf::reacts_to<step_timeout_atom>>;
using scheduler_actor_type = scheduler_self_actor::stateful_pointer<scheduler_state>;

void start_next(scheduler_actor_type self);
void on_all_reported(scheduler_actor_type self);

void finish(scheduler_actor_type self, step_outcome outcome) {
  auto& s = self->state;
  auto request = std::move(s.current);
  s.current.reset();
  request->finish(std::move(outcome));
  start_next(self);
}

void finish_with_error(scheduler_actor_type self, const failure& why) {
  step_outcome outcome;
  outcome.error = std::make_exception_ptr(pipeline_error(why.message, why.details));
  finish(self, std::move(outcome));
}

// A failed request to stage `stage`: the stage's refusal (its kind and sentence), a timeout, a
// stage that is gone, or CAF's error. A stage on a node that is gone is a lost node; a proxy's
// error says itself what it was asked.
failure request_failure(scheduler_actor_type self, std::size_t stage, uint64_t step,
                        const caf::error& err, std::chrono::milliseconds timeout,
                        const std::string& what) {
  const auto& nodes = self->state.options.nodes;
  // The refusal's own fields (actors/pipeline_errc.hpp), completed by what the scheduler knows.
  auto details = is_pipeline_error(err) ? details_of_pipeline_error(err)
                                        : error_details{request_error_kind(err)};
  details.stage = details.stage.value_or(stage);
  details.step = details.step.value_or(step);
  if (details.node.empty() && stage < nodes.size()) {
    details.node = nodes[stage];
  }
  if (details.kind == error_kind::stage_lost && !details.node.empty()) {
    details.kind = error_kind::node_lost;
  }
  auto sentence = carried_sentence(err);
  return failure{std::move(details),
                 sentence ? *sentence
                          : detail::concat("stage ", stage, ", step ", step, ", asked to ", what,
                                           ", ", request_error(self->system(), err, timeout))};
}

// Fails the running step: every stage is told to abort (drop stash and gradients, restore
// buffers), and the step's caller hears of the failure only once all stages confirmed, so that
// the pipeline it then inspects is exactly as before the step.
void fail(scheduler_actor_type self, failure why) {
  auto& s = self->state;
  if (s.aborting) {
    return;
  }
  s.aborting = true;
  if (!why.details.step) {
    why.details.step = s.step;
  }
  s.abort_failure = std::move(why);
  log::get()->warn("step {} fails: {}", s.step, s.abort_failure.message);
  auto step = s.step;
  if (s.options.on_step_failure && s.current && s.current->train()) {
    s.options.on_step_failure(step, s.abort_failure.message);
  }
  // Overlapping steps: the step behind it ran on parameters the failed step would have set; it is
  // aborted first (a stage then undoes both steps' early optimizer steps) and fails with it.
  std::vector<uint64_t> steps;
  if (s.ahead) {
    steps.push_back(step + 1);
  }
  steps.push_back(step);
  s.aborts_pending = s.stages.size() * steps.size();
  auto confirmed = [=](const std::string& note) {
    auto& st = self->state;
    if (!st.current || st.step != step) {
      return;
    }
    if (!note.empty()) {
      st.abort_failure.message += "; " + note;
    }
    if (--st.aborts_pending == 0) {
      if (st.ahead) {
        auto behind = std::move(st.ahead->request);
        st.ahead.reset();
        step_outcome outcome;
        outcome.error = std::make_exception_ptr(pipeline_error(
          detail::concat("step ", step + 1, " did not run: it overlapped step ", step,
                         ", which failed: ", st.abort_failure.message),
          error_details{st.abort_failure.details.kind, std::nullopt, std::nullopt, step + 1}));
        behind->finish(std::move(outcome));
        // Its number is spent: frames of it still on their way are older than the next step.
        st.step = step + 1;
      }
      finish_with_error(self, st.abort_failure);
    }
  };
  for (std::size_t i = 0; i < s.stages.size(); ++i) {
    for (auto aborted : steps) {
      self->request(s.stages[i], s.options.abort_timeout, abort_atom::value, aborted)
        .then([=](bool) { confirmed({}); },
              [=](const caf::error& err) {
                confirmed(detail::concat(
                  "stage ", i, ", asked to abort step ", aborted, ", ",
                  request_error(self->system(), err, self->state.options.abort_timeout)));
              });
    }
  }
}

// The stage actor holding the last virtual stage: it takes the targets and computes the loss, or
// the outputs (stage 0 in a V).
std::size_t last_stage(const scheduler_state& s) {
  return holder_of(s.options.placement, s.stages.size(), s.stages.size() * s.options.chunks - 1)
    .stage;
}

const schedule& schedule_for(scheduler_state& s, std::size_t microbatches, bool train) {
  auto k = std::make_pair(microbatches, train);
  auto it = s.schedules.find(k);
  if (it == s.schedules.end()) {
    schedule plan;
    if (!train) {
      plan =
        make_forward_schedule(s.stages.size(), microbatches, s.options.chunks, s.options.placement);
    } else if (!s.options.custom.empty()) {
      plan = s.options.custom;
      ACTORPIPE_CHECK(plan.size() == s.stages.size(), "the custom schedule has ", plan.size(),
                      " programs for ", s.stages.size(), " stages");
      ACTORPIPE_CHECK(chunks_of(plan) == s.options.chunks, "the custom schedule uses ",
                      chunks_of(plan), " chunks per stage, the pipeline has ", s.options.chunks);
      ACTORPIPE_CHECK(plan.placement == s.options.placement, "the custom schedule places chunks ",
                      to_string(plan.placement), ", the pipeline ", to_string(s.options.placement));
    } else {
      plan = make_schedule(s.options.schedule, s.stages.size(), microbatches, s.options.chunks);
    }
    validate(plan, microbatches, train);
    it = s.schedules.emplace(k, std::move(plan)).first;
  }
  return it->second;
}

// The error of a state request that failed on several stages or one (`otherwise`: the kind of a
// failure that says none): one stage's as it is; several in stage order, their sentences joined,
// with the fields of the most telling (a stage that did not answer, or a lost node, over what
// the files say) and each one's own in failures().
pipeline_error state_request_error(std::vector<failure> failures, error_kind otherwise) {
  for (auto& f : failures) {
    if (f.details.kind == error_kind::other) {
      f.details.kind = otherwise;
    }
  }
  std::sort(failures.begin(), failures.end(),
            [](const failure& a, const failure& b) { return a.details.stage < b.details.stage; });
  if (failures.size() == 1) {
    return pipeline_error(failures.front().message, failures.front().details);
  }
  auto telling = std::find_if(failures.begin(), failures.end(), [](const failure& f) {
    auto k = f.details.kind;
    return k == error_kind::timeout || k == error_kind::node_lost || k == error_kind::stage_lost;
  });
  const auto& lead = telling != failures.end() ? *telling : failures.front();
  std::string message;
  std::vector<failure_part> parts;
  for (const auto& f : failures) {
    message += (message.empty() ? "" : "; ") + f.message;
    parts.push_back({f.details, f.message});
  }
  return pipeline_error(message, lead.details, std::move(parts));
}

// What a stage was asked to do with its state, for its refusal: "stage 2 failed to ...".
const char* state_verb(request_kind kind) {
  switch (kind) {
  case request_kind::fetch:
    return "send its state";
  case request_kind::save:
    return "save its state";
  case request_kind::load:
    return "load its state";
  default:
    return "end its block";
  }
}

// Asks stage `i` to act on its state as `request` says; `fetched` takes a fetched state.
template <class OnDone, class OnError>
void ask_stage_state(scheduler_actor_type self, std::size_t i, const step_request& request,
                     std::shared_ptr<tensor_map> fetched, OnDone one_done, OnError on_error) {
  auto& s = self->state;
  auto done = [=](bool) { one_done(std::nullopt); };
  switch (request.kind) {
  case request_kind::fetch:
    self->request(s.stages[i], s.options.step_timeout, fetch_atom::value, request.keep_as)
      .then(
        [=](std::shared_ptr<const tensor_map>& state) {
          if (state) {
            fetched->insert(state->begin(), state->end());
          }
          one_done(std::nullopt);
        },
        on_error);
    return;
  case request_kind::end_block:
    self->request(s.stages[i], s.options.step_timeout, block_atom::value).then(done, on_error);
    return;
  case request_kind::save:
    self
      ->request(s.stages[i], s.options.step_timeout, save_atom::value,
                stages::stage_file(request.path, i))
      .then(done, on_error);
    return;
  default:
    self->request(s.stages[i], s.options.step_timeout, load_atom::value, request.state)
      .then(done, on_error);
  }
}

// Save, load, fetch or end a BMUF block: every stage acts on its own state; errors are collected,
// then reported together.
void run_state_request(scheduler_actor_type self) {
  auto& s = self->state;
  auto request = s.current;
  auto pending = std::make_shared<std::size_t>(s.stages.size());
  auto failures = std::make_shared<std::vector<failure>>();
  auto fetched = std::make_shared<tensor_map>();
  auto one_done = [=](std::optional<failure> why) {
    if (why) {
      failures->push_back(std::move(*why));
    }
    if (--*pending != 0) {
      return;
    }
    step_outcome outcome;
    if (!failures->empty()) {
      outcome.error = std::make_exception_ptr(state_request_error(
        std::move(*failures),
        request->kind == request_kind::end_block ? error_kind::replica_failure : error_kind::io));
    } else if (request->kind == request_kind::fetch) {
      outcome.state = fetched;
    }
    if (request->background) {
      // The requests after it went on meanwhile.
      request->finish(std::move(outcome));
    } else {
      finish(self, std::move(outcome));
    }
  };
  for (std::size_t i = 0; i < s.stages.size(); ++i) {
    auto on_error = [=](const caf::error& err) {
      one_done(request_failure(self, i, self->state.step, err, self->state.options.step_timeout,
                               state_verb(request->kind)));
    };
    ask_stage_state(self, i, *request, fetched, one_done, on_error);
  }
  if (request->background) {
    // Every stage has the fetch in its mailbox before anything the next request sends it, so
    // each copies its state as it is now; the copies travel while the next steps run.
    s.current.reset();
    start_next(self);
  }
}

// Sends every stage its plan for step `step` of `request`.
void send_plans(scheduler_actor_type self, step_request& request, uint64_t step,
                clock_type::time_point started, const schedule& programs) {
  auto& s = self->state;
  auto last = last_stage(s);
  auto origin =
    std::chrono::duration_cast<std::chrono::nanoseconds>(started.time_since_epoch()).count();
  bool overlap = request.train() && s.options.overlap_steps;
  int64_t samples = 0;
  for (const auto& mb : request.inputs) {
    samples += mb.size(0);
  }
  for (std::size_t i = 0; i < s.stages.size(); ++i) {
    step_plan plan;
    plan.step = step;
    plan.train = request.train();
    plan.microbatches = static_cast<int32_t>(request.inputs.size());
    plan.origin_ns = origin;
    plan.program = programs[i];
    plan.learning_rate = request.learning_rate;
    // Post-validation: every stage but the one that reported last the step before (whose
    // early step would only delay its report's confirmation) steps its optimizer at once,
    // unless the step before was clipped (this one likely is too, and would be stepped twice).
    // Overlapping steps: every stage, so that it can go on to the next step at once.
    plan.optimistic = request.train() && (s.options.optimistic_update || overlap) &&
                      !s.last_clipped && (overlap || i != s.last_reporter);
    plan.overlapped = overlap;
    if (i == 0) {
      plan.inputs = request.inputs;
    }
    if (i == last && request.train()) {
      plan.targets = request.targets;
      plan.loss_scales = request.loss_scales;
      if (s.options.inputs_to_loss) {
        plan.loss_inputs = request.inputs;
      }
    }
    plan.samples = samples;
    self->send(s.stages[i], plan_atom::value, std::move(plan));
  }
}

// Overlapping steps: while a training step runs, the next queued training step goes to the
// stages at once; each starts it when it is done with the running one (step_plan::overlapped).
void send_ahead(scheduler_actor_type self) {
  auto& s = self->state;
  if (!s.options.overlap_steps || !s.current || !s.current->train() || s.ahead || s.aborting ||
      s.broken || s.queue.empty() || !s.queue.front()->train()) {
    return;
  }
  const schedule* programs = nullptr;
  try {
    programs = &schedule_for(s, s.queue.front()->inputs.size(), /*train=*/true);
  } catch (const std::exception&) {
    // It fails with this error when its turn comes.
    return;
  }
  scheduler_state::ahead_step next;
  next.request = std::move(s.queue.front());
  s.queue.pop_front();
  next.started = clock_type::now();
  next.reports.resize(s.stages.size());
  send_plans(self, *next.request, s.step + 1, next.started, *programs);
  s.ahead = std::move(next);
}

// The running request becomes the next step, started at `started` with the reports already in.
void begin_step(scheduler_state& s, clock_type::time_point started,
                std::vector<stage_report> reports, std::size_t reported) {
  ++s.step;
  s.started = started;
  s.reports = std::move(reports);
  s.reported = reported;
  s.updated = 0;
  s.grad_norm = 0;
  s.aborting = false;
}

// Makes the step sent ahead the running one.
void run_ahead(scheduler_actor_type self) {
  auto& s = self->state;
  auto next = std::move(*s.ahead);
  s.ahead.reset();
  s.current = std::move(next.request);
  begin_step(s, next.started, std::move(next.reports), next.reported);
  s.deadline.arm(self, s.options.step_timeout, step_timeout_atom::value);
  if (next.failed) {
    fail(self, std::move(*next.failed));
    return;
  }
  send_ahead(self);
  if (s.reported == s.stages.size()) {
    on_all_reported(self);
  }
}

void start_next(scheduler_actor_type self) {
  auto& s = self->state;
  if (s.current) {
    return;
  }
  if (s.ahead) {
    run_ahead(self);
    return;
  }
  if (s.queue.empty()) {
    return;
  }
  s.current = std::move(s.queue.front());
  s.queue.pop_front();
  if (s.broken) {
    finish_with_error(self, *s.broken);
    return;
  }
  auto& request = *s.current;
  if (request.kind == request_kind::save || request.kind == request_kind::load ||
      request.kind == request_kind::fetch || request.kind == request_kind::end_block) {
    run_state_request(self);
    return;
  }
  begin_step(s, clock_type::now(), std::vector<stage_report>(s.stages.size()), 0);
  const schedule* programs = nullptr;
  try {
    programs = &schedule_for(s, request.inputs.size(), request.train());
  } catch (const std::exception& e) {
    step_outcome outcome;
    outcome.error = std::current_exception();
    finish(self, std::move(outcome));
    return;
  }
  send_plans(self, request, s.step, s.started, *programs);
  s.deadline.arm(self, s.options.step_timeout, step_timeout_atom::value);
  send_ahead(self);
}

// The step's result from the stages' reports: the last stage's loss and outputs, every stage's
// figures.
step_outcome outcome_of_step(scheduler_state& s) {
  step_outcome outcome;
  outcome.result.step = s.step;
  auto last = last_stage(s);
  outcome.result.loss = s.reports[last].loss;
  outcome.result.grad_norm = s.grad_norm;
  outcome.result.wall_ms =
    std::chrono::duration<double, std::milli>(clock_type::now() - s.started).count();
  outcome.result.placement = s.options.placement;
  for (auto& r : s.reports) {
    outcome.result.stages.push_back(r.stats);
  }
  outcome.outputs = std::move(s.reports[last].outputs);
  log::get()->debug("step {} ({}) done in {:.1f} ms, loss {}", s.step,
                    s.current->train() ? "train" : "forward", outcome.result.wall_ms,
                    outcome.result.loss);
  return outcome;
}

// Clipping: the scale of the gradients from the global norm over every stage's report (1 when
// not clipping); none when the norm is not finite, and the step has failed.
std::optional<double> gradient_scale_of(scheduler_actor_type self) {
  auto& s = self->state;
  if (s.options.max_grad_norm <= 0) {
    return 1.0;
  }
  double sum = 0;
  for (const auto& r : s.reports) {
    sum += r.gradient_square_sum;
  }
  s.grad_norm = std::sqrt(sum);
  if (!std::isfinite(s.grad_norm)) {
    // Stepping would write NaNs into every parameter: the step fails, and the stages' early
    // optimizer steps are undone with it.
    fail(self, failure{{error_kind::stage_failure, std::nullopt, std::nullopt, s.step},
                       detail::concat("step ", s.step, ": the global gradient norm is ",
                                      std::isnan(s.grad_norm) ? "NaN" : "infinite",
                                      " (a NaN or an infinity in the gradients); no parameter "
                                      "changed")});
    return std::nullopt;
  }
  auto scale = std::min(1.0, s.options.max_grad_norm / (s.grad_norm + 1e-6));
  s.last_clipped = scale < 1.0;
  return scale;
}

void on_all_reported(scheduler_actor_type self) {
  auto& s = self->state;
  if (!s.current->train()) {
    finish(self, outcome_of_step(s));
    return;
  }
  // Every stage has its gradients: only now may any optimizer step, so that a failed step
  // changes no parameter anywhere.
  auto step = s.step;
  auto gradient_scale = gradient_scale_of(self);
  if (!gradient_scale) {
    return;
  }
  for (std::size_t i = 0; i < s.stages.size(); ++i) {
    self
      // No timer per request: the step's deadline covers the optimizer steps too.
      ->request(s.stages[i], caf::infinite, update_atom::value, step, s.current->learning_rate,
                *gradient_scale)
      .then(
        [=](double optimizer_ms) {
          auto& st = self->state;
          if (!st.current || st.step != step || st.aborting) {
            return;
          }
          st.reports[i].stats.optimizer_ms = optimizer_ms;
          if (++st.updated == st.stages.size()) {
            finish(self, outcome_of_step(st));
          }
          linger(self, st.options.linger);
        },
        [=](const caf::error& err) {
          auto& st = self->state;
          if (st.current && st.step == step) {
            fail(self, request_failure(self, i, step, err, st.options.step_timeout,
                                       "step its optimizer"));
          }
        });
  }
}

// A stage actor went: the pipeline is broken, and the running step fails with it.
void on_stage_down(scheduler_actor_type self, const caf::down_msg& msg) {
  auto& s = self->state;
  for (std::size_t i = 0; i < s.stages.size(); ++i) {
    if (s.stages[i].address() != msg.source) {
      continue;
    }
    auto on_node = i < s.options.nodes.size() && !s.options.nodes[i].empty();
    s.broken =
      failure{{on_node ? error_kind::node_lost : error_kind::stage_lost, i, std::nullopt,
               std::nullopt, on_node ? s.options.nodes[i] : ""},
              detail::concat("stage ", i, " terminated (", self->system().render(msg.reason),
                             "); the pipeline cannot run further steps")};
    if (s.current) {
      auto why = *s.broken;
      why.message = detail::concat("step ", s.step, ": ", why.message);
      fail(self, std::move(why));
    }
    return;
  }
}

// A stage's report of its program; the optimizer steps once every stage has reported.
void on_report(scheduler_actor_type self, stage_report& report) {
  auto& s = self->state;
  if (s.ahead && report.step == s.step + 1) {
    // Overlapping steps: kept until the step before is done.
    s.ahead->reports[report.stats.stage] = std::move(report);
    ++s.ahead->reported;
    return;
  }
  if (!s.current || report.step != s.step || s.aborting) {
    return;
  }
  auto index = report.stats.stage;
  s.reports[index] = std::move(report);
  if (++s.reported == s.stages.size()) {
    s.last_reporter = index;
    on_all_reported(self);
  }
  linger(self, s.options.linger);
}

// The step's deadline fired: the step fails, unless it ended meanwhile.
void on_step_deadline(scheduler_actor_type self) {
  auto& s = self->state;
  bool stepping = s.current && (s.current->kind == request_kind::train ||
                                s.current->kind == request_kind::forward);
  if (!s.deadline.expired(self, stepping, s.started, s.options.step_timeout,
                          step_timeout_atom::value)) {
    return;
  }
  fail(self, failure{{error_kind::timeout, std::nullopt, std::nullopt, s.step},
                     detail::concat("step ", s.step, " did not finish within ",
                                    s.options.step_timeout.count(), " ms (", s.reported, " of ",
                                    s.stages.size(), " stages reported)")});
}

scheduler_self_actor::behavior_type scheduler_behavior(scheduler_actor_type self,
                                                       scheduler_options options) {
  self->state.options = options;
  self->state.step = options.first_step;
  self->set_down_handler([=](caf::down_msg& msg) { on_stage_down(self, msg); });
  return {
    [=](connect_atom, std::vector<stage_actor>& stages) {
      for (auto& stage : stages) {
        self->monitor(stage);
      }
      self->state.stages = std::move(stages);
    },
    [=](run_atom, std::shared_ptr<step_request>& request) {
      self->state.queue.push_back(std::move(request));
      start_next(self);
      send_ahead(self);
      linger(self, self->state.options.linger);
    },
    [=](done_atom, stage_report& report) { on_report(self, report); },
    [=](failed_atom, uint64_t step, failure& why) {
      auto& s = self->state;
      if (s.current && step == s.step) {
        fail(self, std::move(why));
      } else if (s.ahead && step == s.step + 1 && !s.ahead->failed) {
        // It fails (and is aborted) when its turn comes; the step before goes on meanwhile.
        s.ahead->failed = std::move(why);
      }
    },
    [=](step_timeout_atom) { on_step_deadline(self); },
  };
}

} // namespace

scheduler_actor spawn_scheduler(caf::actor_system& sys, scheduler_options options) {
  // Detached: a thread of its own wakes on each message at once, where a pooled worker in CAF's
  // relaxed polling mode may sleep for milliseconds (measured: 1.4 ms per step on the pool).
  return sys.spawn<caf::detached>(scheduler_behavior, options);
}

} // namespace actorpipe::scheduler
