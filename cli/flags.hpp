/// \file
/// The flags `actorpipe train`, `plan` and `bench` share: which model and data, and how the
/// pipeline is cut and scheduled (the settings are training/model_setup.hpp's and
/// training/planning.hpp's).
#pragma once

#include <chrono>
#include <functional>
#include <string>

#include "training/model_setup.hpp"
#include "training/planning.hpp"

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
void add_pipeline_flags(CLI::App* cmd, planning_args& args);
/// --recompute (train, plan): sets args.recompute and recompute_given.
void add_recompute_flag(CLI::App* cmd, planning_args& args);
/// A check that a number given to a flag is at least `least` ("must be >= 0", not CLI11's range
/// up to the largest double).
CLI::Validator at_least(double least);
/// A flag whose text `set` parses into an option struct's field (an enum, by the library's own
/// parse function): what the parser refuses is reported as the flag's error ("--precision:
/// unknown precision 'fp16' (choose fp32 or bf16)"); help shows `shown` as its default.
CLI::Option* add_parsed_flag(CLI::App* cmd, const std::string& name,
                             std::function<void(const std::string&)> set, const std::string& shown,
                             const std::string& help);
/// A flag of whole milliseconds that fills `field` (an option struct's duration) directly, at
/// least `least` (refused by name below it); its default is the field's.
CLI::Option* add_milliseconds_flag(CLI::App* cmd, const std::string& name,
                                   std::chrono::milliseconds& field, int64_t least,
                                   const std::string& help);

} // namespace actorpipe::cli
