#include "cli/plan_command.hpp"

#include <cstdio>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <actorpipe/trace.hpp>

namespace actorpipe::cli {

CLI::App* add_plan_command(CLI::App& app, plan_args& a) {
  auto* cmd = app.add_subcommand(
    "plan", "Profile a model's layers on a sample micro-batch and show the chosen cut (layers, "
            "parameters, time, activation size per stage) and the simulated schedule");
  add_model_flags(cmd, a.model);
  add_pipeline_flags(cmd, a.plan);
  cmd->add_option("--svg", a.svg, "Draw the planned schedule as a Gantt chart into this SVG file");
  return cmd;
}

int run_plan(const plan_args& a) {
  auto setup = build_model(a.model);
  auto choice = choose_plan(setup.layers, setup.sample(), a.plan, /*always_profile=*/true);
  const auto& cut = choice.cut;
  auto p = cut.stages() / choice.chunks;
  auto scale = static_cast<double>(setup.batch) / static_cast<double>(choice.microbatches) /
               static_cast<double>(choice.profiled_samples);
  std::printf("actorpipe plan: %s, batch %lld, %zu stages x %zu chunk(s), %zu micro-batches, "
              "schedule %s, partition %s\n",
              setup.name.c_str(), static_cast<long long>(setup.batch), p, choice.chunks,
              choice.microbatches, choice.schedule_name.c_str(), a.plan.partition.c_str());
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
  auto plan = choice.custom.empty()
                ? make_schedule(choice.kind, p, choice.microbatches, choice.chunks)
                : choice.custom;
  validate(plan, choice.microbatches, true);
  auto sim = simulate(plan, choice.microbatches, costs_of(choice.profile, cut, scale));
  std::printf("simulated step: %.1f ms, mean bubble %.1f%%\n", sim.makespan,
              100 * sim.mean_bubble());
  for (std::size_t s = 0; s < p; ++s) {
    std::printf("  stage %zu: busy %.1f ms, bubble %.1f%%, peak stash %.2f micro-batches\n", s,
                sim.busy[s], 100 * sim.bubble[s], sim.peak_stash[s]);
  }
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
