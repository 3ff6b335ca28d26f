/// \file
/// `actorpipe plan`: shows how a model would be cut and scheduled, without training.
#pragma once

#include <string>
#include <vector>

#include "cli/flags.hpp"

namespace CLI {
class App;
}

namespace actorpipe::cli {

struct plan_args {
  model_args model;
  planning_args plan;
  std::string svg;
  /// --devices, --link: a projection onto other machines instead of this one.
  std::vector<std::size_t> devices;
  std::string link;
  /// --profile-device: the device the layers are profiled on (a GPU's times and memory).
  std::string profile_device;
};

CLI::App* add_plan_command(CLI::App& app, plan_args& args);

/// Profiles the layers, prints per-stage layers, parameters, time and activation sizes and the
/// simulated step; draws the planned schedule with --svg. Returns the exit code.
int run_plan(const plan_args& args);

} // namespace actorpipe::cli
