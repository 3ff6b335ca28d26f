/// \file
/// A run's settings, each declared once: its name, the kind of value it takes, its default, its
/// help, the front ends that take it, how its text sets a run_settings and where it applies.
/// `actorpipe train`'s flags (and with them its config file's keys), `actorpipe plan`'s and
/// `bench`'s, and the Python module's keyword arguments are all bound from this one table; a new
/// setting is a row of settings.cpp plus the code that reads it. What is not text (the loss, the
/// optimizer, hooks, the model) each front end brings to settings_for, the one function that
/// completes a run's settings before plan_run.
#pragma once

#include <cstddef>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <actorpipe/options.hpp>

#include "training/run_plan.hpp"

namespace actorpipe::training {

/// What a setting's text is; each front end spells it its own way (Python: int, float, bool,
/// str, seconds for milliseconds; the CLI: a flag's text).
enum class setting_kind { count, number, text, flag, milliseconds };

/// "count", "number", "text", "flag", "milliseconds": the kind as Python's package reads it.
const char* to_string(setting_kind kind);

/// The front ends that bind a setting (a row's `front_ends`, or-ed).
enum front_end : unsigned { train_front = 1, plan_front = 2, bench_front = 4, python_front = 8 };

/// How a front end spells a setting's name in its messages ("--stages", "stages").
using setting_spelling = std::function<std::string(const std::string& name)>;

/// One row of the table.
struct setting {
  /// snake_case: Python's keyword; the CLI's flag is `--` and the name with dashes.
  const char* name;
  setting_kind kind;
  unsigned front_ends;
  /// The default, as the CLI shows it ("2", "fp32", "60000").
  std::string shown;
  std::string help;
  /// Sets the setting from its text; throws invalid_argument saying why not (without its name).
  std::function<void(run_settings&, const std::string&)> set;
  /// Why the setting, given, does not apply to the rest of a run's settings (naming other
  /// settings as the front end spells them); nullopt where it does. Empty: it applies everywhere.
  std::function<std::optional<std::string>(const run_settings&, const setting_spelling&)> applies;

  /// "--max-grad-norm" for max_grad_norm (flag_for).
  std::string flag() const;
  bool bound_by(front_end f) const { return (front_ends & f) != 0; }
};

/// The CLI's flag for a setting's name, or for another of the CLI's names in snake_case
/// ("--max-grad-norm" for max_grad_norm, "--nodes" for nodes).
std::string flag_for(const std::string& name);

/// Every setting, in the order the CLI's help lists them.
const std::vector<setting>& setting_table();

/// The row named `name` (snake_case), else nullptr.
const setting* find_setting(const std::string& name);

/// Sets `row` in `s` from `text` and records it as given; invalid_argument naming it as `spell`
/// does ("precision: unknown precision 'fp16' (choose fp32 or bf16)").
void set_setting(run_settings& s, const setting& row, const std::string& text,
                 const setting_spelling& spell);

/// What a front end brings beside its settings' text: made things, and the replicas and nodes
/// each front end finds its own way (the CLI also from a launcher's variables).
struct run_parts {
  loss_function loss;
  optimizer_spec optimizer;
  hook_specs hooks;
  /// The nodes' secret (training::secret_from) and their addresses, replica after replica.
  std::string secret;
  std::vector<std::string> nodes;
  /// Replicas of the pipeline in all (1: none).
  std::size_t replicas = 1;
  /// Each replica in this process runs a loop of its own on a thread of its own (the CLI's
  /// --replicas), meeting the others at an in-process store; else one loop feeds them all.
  bool replica_loops = false;
};

/// A run's settings, complete: the declared ones checked where they apply (each refusal naming
/// the setting as `spell` spells it), the parts set in, the replicas laid out. The one function
/// `actorpipe train` and the Python module both call before plan_run. `declared.plan.devices` and
/// `declared.pipeline.data_parallel` (a launcher's rank and world) are the front end's already.
run_settings settings_for(run_settings declared, run_parts parts, const setting_spelling& spell);

/// "a count >= 1 or auto" as settings read it: nullopt for "auto"; invalid_argument otherwise.
std::optional<std::size_t> count_or_auto(const std::string& text, std::size_t least);

/// Bytes with a unit ("512MB", "5GiB", "4096B") or a bare count of bytes; invalid_argument
/// otherwise.
uint64_t parse_bytes(const std::string& text);

} // namespace actorpipe::training
