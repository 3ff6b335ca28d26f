/// \file
/// The flags `actorpipe train`, `plan` and `bench` share: which model and data, and the run's
/// settings as training/settings.hpp declares them (the model's are training/model_setup.hpp's).
#pragma once

#include <chrono>
#include <functional>
#include <string>

#include "training/model_setup.hpp"
#include "training/planning.hpp"
#include "training/settings.hpp"

namespace CLI {
class App;
class Option;
class Validator;
} // namespace CLI

namespace actorpipe::cli {

using training::build_model;
using training::choose_plan;
using training::model_args;
using training::model_setup;
using training::plan_choice;
using training::planning_args;
using training::threads_per_stage;

void add_model_flags(CLI::App* cmd, model_args& args);
/// "5GiB", "512MB", "4096B" or a count of bytes, for `flag`; CLI::ValidationError otherwise.
uint64_t parse_bytes(const char* flag, const std::string& value);
/// A check that a number given to a flag is at least `least` ("must be >= 0", not CLI11's range
/// up to the largest double).
CLI::Validator at_least(double least);
/// The flags of the run's settings (training/settings.hpp's table) that `front` binds, each
/// setting `s` as it is given (a refusal is the flag's error, named as the flag); their defaults
/// are the table's.
void add_setting_flags(CLI::App* cmd, training::run_settings& s, training::front_end front);
/// The same for a command that takes the planner's settings alone (plan, bench): `plan` holds
/// them once the command line is parsed.
void add_plan_flags(CLI::App* cmd, planning_args& plan, training::front_end front);

} // namespace actorpipe::cli
