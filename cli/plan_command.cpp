#include "cli/plan_command.hpp"

#include <cmath>
#include <cstdio>
#include <tuple>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <actorpipe/trace.hpp>

#include "stages/device.hpp"
#include "training/run_plan.hpp"

namespace actorpipe::cli {

CLI::App* add_plan_command(CLI::App& app, plan_args& a) {
  auto* cmd = app.add_subcommand(
    "plan", "Profile a model's layers on a sample micro-batch and show the chosen cut (layers, "
            "parameters, time, activation size per stage) and the simulated schedule; with "
            "--stages auto (or --schedule/--threads auto) the planner's ranking of layouts");
  add_model_flags(cmd, a.model);
  add_plan_flags(cmd, a.plan, training::plan_front);
  cmd->add_option("--svg", a.svg, "Draw the planned schedule as a Gantt chart into this SVG file");
  cmd->add_option("--profile-device", a.profile_device,
                  "Profile the layers on this device (cpu, cuda or cuda:N; default cpu): the "
                  "times and memory of stages on that GPU, to compare with `train --devices` "
                  "(docs/memory.md); the CUDA build only");
  cmd
    ->add_option("--devices", a.devices,
                 "Project a step onto other machines instead: device counts, e.g. 8,16,64, each "
                 "device computing as one stage here does at --threads (default 1); every "
                 "stages x replicas layout of each count is ranked (docs/scaling.md)")
    ->delimiter(',');
  cmd->add_option("--link", a.link,
                  "With --devices: the network between devices, GBPS,LATENCY_MS (e.g. 12.5,0.005 "
                  "for 100 Gb/s with 5 us); activations, gradients and all-reduces cross it "
                  "(default: free transfers)");
  return cmd;
}

namespace {

std::pair<double, double> parse_link(const std::string& link) {
  auto comma = link.find(',');
  std::size_t used_a = 0;
  std::size_t used_b = 0;
  double gbps = -1;
  double latency = -1;
  try {
    gbps = std::stod(link.substr(0, comma), &used_a);
    latency = std::stod(link.substr(comma + 1), &used_b);
  } catch (const std::exception&) {
    used_a = 0;
  }
  ACTORPIPE_CHECK(comma != std::string::npos && used_a == comma && used_a > 0 &&
                    used_b == link.size() - comma - 1 && gbps > 0 && latency >= 0,
                  "--link '", link,
                  "' is not GBPS,LATENCY_MS (bandwidth > 0 in GB/s, latency >= 0 in ms, e.g. "
                  "12.5,0.005)");
  return {gbps, latency};
}

// A projection's table: each device count's layout as `layout_of` picks it, or why none.
template <class Layout, class Missing>
void print_projection_table(const model_setup& setup, const training::projection& projected,
                            const Layout& layout_of, const Missing& missing) {
  double one = 0;
  for (const auto& r : projected.rows) {
    if (r.devices == 1 && r.found) {
      one = r.best.step_ms;
    }
  }
  std::printf("  %7s %6s %8s %5s %-14s %11s %7s %8s %9s %9s %10s %8s %9s\n", "devices", "stages",
              "replicas", "m", "schedule", "step ms", "bubble", "send ms", "reduce ms", "update ms",
              "samples/s", "speedup", "ranked in");
  for (const auto& r : projected.rows) {
    const layout* l = layout_of(r);
    if (l == nullptr) {
      missing(r);
      continue;
    }
    std::printf(
      "  %7zu %6zu %8zu %5zu %-14s %11.1f %6.1f%% %8.3f %9.2f %9.2f %10.1f %7.2fx %6.1f ms"
      "\n",
      r.devices, l->stages, l->replicas, l->microbatches,
      (to_string(l->schedule) + (l->chunks > 1 ? " x" + std::to_string(l->chunks) : "")).c_str(),
      l->step_ms, 100 * l->bubble, l->send_ms, l->allreduce_ms, l->update_ms,
      static_cast<double>(setup.batch) / (l->step_ms / 1000), one > 0 ? one / l->step_ms : 0.0,
      r.ranking_ms);
  }
}

int run_projection(const plan_args& a) {
  auto setup = build_model(a.model);
  training::projection_args p;
  p.devices = a.devices;
  if (!a.link.empty()) {
    std::tie(p.link_gbps, p.link_latency_ms) = parse_link(a.link);
  }
  auto projected = training::project(setup.layers, setup.sample(), a.plan, p);
  std::printf(
    "projection: %s, batch %lld, %zu layers; each device computes as one stage here at "
    "%zu thread(s) (costs profiled on micro-batches of %lld); link %s\n",
    setup.name.c_str(), static_cast<long long>(setup.batch), setup.layers.size(), projected.threads,
    static_cast<long long>(projected.samples),
    a.link.empty()
      ? "none (transfers free)"
      : detail::concat(p.link_gbps, " GB/s, ", p.link_latency_ms, " ms per message").c_str());
  using row = training::projection_row;
  std::printf("the fastest layout of each device count:\n");
  print_projection_table(
    setup, projected, [](const row& r) { return r.found ? &r.best : nullptr; },
    [](const row& r) {
      std::printf("  %7zu  no layout fits (at most one stage per layer, one replica per sample, "
                  "within --max-stash)\n",
                  r.devices);
    });
  std::printf("a pipeline only (every device a stage):\n");
  print_projection_table(
    setup, projected, [](const row& r) { return r.pipeline_found ? &r.pipeline : nullptr; },
    [&](const row& r) {
      std::printf("  %7zu  no pipeline: %s has %zu layers\n", r.devices, setup.name.c_str(),
                  setup.layers.size());
    });
  std::printf("each row: the fastest layout of stages x replicas == devices (every schedule, "
              "time-balanced cuts), each replica's batch in micro-batches of the profiled size (m "
              "per replica); reduce: the gradient all-reduce between replicas after the step; "
              "update: the optimizer step; ranked in: the planner's time for the row\n");
  return 0;
}

// The plan's parts (virtual stages): their layers, parameters, costs and sends, each cost at
// `scale` times the profiled micro-batch.
void print_parts(const model_setup& setup, const training::plan_choice& choice, double scale) {
  const auto& cut = choice.cut;
  std::printf("  %-5s %-24s %12s %12s %12s %14s\n", "part", "layers", "parameters", "forward ms",
              "backward ms", "sends (bytes)");
  for (std::size_t k = 0; k < cut.stages(); ++k) {
    double f = 0;
    double b = 0;
    int64_t params = 0;
    for (auto i = cut.begin(k); i < cut.end(k); ++i) {
      f += choice.profile[i].forward_ms * scale;
      b += choice.profile[i].backward_ms * scale;
      params += choice.profile[i].parameters;
    }
    auto sends = k + 1 < cut.stages()
                   ? static_cast<double>(choice.profile[cut.end(k) - 1].output_bytes) * scale
                   : 0.0;
    auto names = setup.layers[cut.begin(k)].name() + ".." + setup.layers[cut.end(k) - 1].name();
    std::printf("  %-5zu %-24s %12lld %12.1f %12.1f %14.0f\n", k, names.c_str(),
                static_cast<long long>(params), f, b, sends);
  }
}

} // namespace

// The simulated step per stage actor, with what it is predicted to hold at its peak
// (estimate_memory; `optimizer_state` tensors per parameter).
void print_stages(const schedule& plan, const training::plan_choice& choice, const simulation& sim,
                  double scale, double optimizer_state) {
  std::printf("simulated step: %.1f ms, mean bubble %.1f%%; predicted memory per stage with %g "
              "optimizer tensor(s) per parameter%s (docs/memory.md)\n",
              sim.makespan, 100 * sim.mean_bubble(), optimizer_state,
              recompute_suffix(choice.recompute).c_str());
  for (std::size_t s = 0; s < plan.programs.size(); ++s) {
    auto m = stage_memory(choice.profile, choice.cut, plan, s, scale, optimizer_state,
                          choice.recompute, choice.microbatches);
    std::printf("  stage %zu: busy %.1f ms, bubble %.1f%%, peak stash %.2f micro-batches; memory "
                "%.1f MB (parameters %.1f, gradients %.1f, optimizer %.1f, activations %.1f, "
                "working %.1f, workspace %.1f)\n",
                s, sim.busy[s], 100 * sim.bubble[s], sim.peak_stash[s],
                static_cast<double>(m.total()) / 1e6, static_cast<double>(m.parameters) / 1e6,
                static_cast<double>(m.gradients) / 1e6, static_cast<double>(m.optimizer) / 1e6,
                static_cast<double>(m.activations) / 1e6, static_cast<double>(m.working) / 1e6,
                static_cast<double>(m.workspace) / 1e6);
  }
}

int run_plan(const plan_args& given) {
  auto a = given;
  if (a.plan.optimizer_state < 0) {
    // What `actorpipe train` would use without optimizer flags.
    a.plan.optimizer_state = training::default_optimizer_for(a.model).state_tensors();
  }
  ACTORPIPE_CHECK(a.link.empty() || !a.devices.empty(),
                  "--link applies to projections: give --devices too");
  if (!a.devices.empty()) {
    ACTORPIPE_CHECK(!a.plan.stages_given && a.plan.max_stages == 0 && !a.plan.threads_auto,
                    "--devices projects every stages x replicas layout itself: --stages, "
                    "--max-stages and --threads auto do not apply");
    ACTORPIPE_CHECK(a.svg.empty(), "--svg draws this machine's plan, not a projection");
    return run_projection(a);
  }
  if (!a.profile_device.empty()) {
    ACTORPIPE_CHECK(!a.plan.layout_auto(),
                    "--profile-device profiles a given layout's layers; with --stages or "
                    "--threads auto give the devices the planner may use to train's --devices");
    a.plan.devices = training::parse_devices({a.profile_device}, a.plan, "--profile-device");
    stages::check_device(a.plan.devices.front(), "--profile-device");
  }
  auto setup = build_model(a.model);
  const auto planned =
    training::plan_layout(setup.layers, setup.sample(), a.plan, /*always_profile=*/true);
  const auto& choice = planned.choice();
  const auto& cut = choice.cut;
  auto p = cut.stages() / choice.chunks;
  auto scale = static_cast<double>(setup.batch) / static_cast<double>(choice.microbatches) /
               static_cast<double>(choice.profiled_samples);
  auto threads = choice.threads > 0 ? choice.threads : threads_per_stage(p, a.plan.threads);
  std::printf("actorpipe plan: %s, batch %lld, %zu stages x %zu chunk(s), %zu thread(s) per stage, "
              "%zu micro-batches, schedule %s, partition %s\n",
              setup.name.c_str(), static_cast<long long>(setup.batch), p, choice.chunks, threads,
              choice.microbatches, choice.schedule_name.c_str(),
              choice.ranking.empty() ? a.plan.partition.c_str()
                                     : choice.ranking.front().partition_spec.c_str());
  std::printf("profiled at %lld samples per micro-batch; the largest spread of a layer's timed "
              "rounds (interquartile range / median): %.1f%%\n",
              static_cast<long long>(choice.profiled_samples),
              100 * profile_spread(choice.profile));
  print_parts(setup, choice, scale);
  auto plan = choice.custom.empty()
                ? make_schedule(choice.kind, p, choice.microbatches, choice.chunks)
                : choice.custom;
  validate(plan, choice.microbatches, true);
  auto costs = costs_of(choice.profile, cut, scale);
  charge_recomputation(costs, choice.recompute, choice.microbatches);
  auto sim = simulate(plan, choice.microbatches, costs);
  print_stages(plan, choice, sim, scale, a.plan.optimizer_state);
  if (!a.svg.empty()) {
    write_gantt_svg(a.svg, sim.timeline,
                    detail::concat("planned ", choice.schedule_name, ": ", setup.name, ", ", p,
                                   " stages, ", choice.microbatches, " micro-batches"),
                    "ms");
    std::printf("wrote %s\n", a.svg.c_str());
  }
  return 0;
}

} // namespace actorpipe::cli
