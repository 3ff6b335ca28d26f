/// \file
/// The flags `actorpipe train`, `plan` and `bench` share: which model and data, and how the
/// pipeline is cut and scheduled (the settings are training/planning.hpp's).
#pragma once

#include "training/planning.hpp"

namespace CLI {
class App;
}

namespace actorpipe::cli {

using training::build_model;
using training::choose_plan;
using training::model_args;
using training::model_setup;
using training::pipeline_options_for;
using training::plan_choice;
using training::planning_args;
using training::threads_per_stage;

void add_model_flags(CLI::App* cmd, model_args& args);
void add_pipeline_flags(CLI::App* cmd, planning_args& args);
/// --recompute (train, plan): sets args.recompute and recompute_given.
void add_recompute_flag(CLI::App* cmd, planning_args& args);

} // namespace actorpipe::cli
