#include "cli/config_file.hpp"

#include <algorithm>
#include <fstream>
#include <regex>

#include <fmt/format.h>

namespace actorpipe::cli {
namespace {

// One `key = value` line of the file, its key with its section ("train.steps").
struct entry {
  int line = 0;
  std::string key;
  std::string value;
};

std::string trim(const std::string& s) {
  auto first = s.find_first_not_of(" \t\r");
  auto last = s.find_last_not_of(" \t\r");
  return first == std::string::npos ? "" : s.substr(first, last - first + 1);
}

// The line up to a `#` outside quotes.
std::string without_comment(const std::string& s) {
  char quote = 0;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (quote != 0) {
      quote = s[i] == quote ? 0 : quote;
    } else if (s[i] == '"' || s[i] == '\'') {
      quote = s[i];
    } else if (s[i] == '#') {
      return s.substr(0, i);
    }
  }
  return s;
}

// The keys as CLI's TOML reader sees them: `[section]` heads and `key = value` lines (the other
// lines of a value spread over several, as an array's, are not keys).
std::vector<entry> entries_of(std::istream& in) {
  static const std::regex head(R"(^\[\s*([A-Za-z0-9_.-]+)\s*\]$)");
  std::vector<entry> out;
  std::string section;
  std::string text;
  for (int n = 1; std::getline(in, text); ++n) {
    auto line = trim(without_comment(text));
    std::smatch m;
    if (std::regex_match(line, m, head)) {
      section = m[1];
      continue;
    }
    auto eq = line.find('=');
    if (eq == std::string::npos || eq == 0) {
      continue;
    }
    auto key = trim(line.substr(0, eq));
    out.push_back({n, section.empty() ? key : section + "." + key, trim(line.substr(eq + 1))});
  }
  return out;
}

std::size_t distance(const std::string& a, const std::string& b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) {
    row[j] = j;
  }
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      auto up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

// ", did you mean 'steps'?" for the command's nearest flag, when one is near.
std::string nearest(const CLI::App& command, const std::string& key) {
  std::string best;
  std::size_t best_distance = 3;
  for (const auto* option : command.get_options()) {
    for (const auto& name : option->get_lnames()) {
      auto d = distance(key, name);
      if (d < best_distance) {
        best = name;
        best_distance = d;
      }
    }
  }
  return best.empty() ? "" : fmt::format(" (did you mean '{}'?)", best);
}

const CLI::Option* flag_of(const CLI::App& command, const std::string& key) {
  return command.get_option_no_throw("--" + key);
}

const CLI::App* command_named(const CLI::App& app, const std::string& name) {
  for (const auto* c : app.get_subcommands([](const CLI::App*) { return true; })) {
    if (c->get_name() == name) {
      return c;
    }
  }
  return nullptr;
}

// What is wrong with the key of `e`, if anything: a key no command has, or one in the wrong place.
std::optional<std::string> misplaced(const CLI::App& app, const entry& e) {
  auto dot = e.key.find('.');
  if (dot == std::string::npos) {
    if (flag_of(app, e.key) != nullptr) {
      return std::nullopt;
    }
    const auto* train = command_named(app, "train");
    if (train != nullptr && flag_of(*train, e.key) != nullptr) {
      return fmt::format("'{0}' is a flag of `actorpipe train`, and keys outside a section are "
                         "the program's own: put it under [train], or write it as train.{0}",
                         e.key);
    }
    return fmt::format("'{}' is no flag of actorpipe{}", e.key, nearest(app, e.key));
  }
  auto name = e.key.substr(0, dot);
  auto key = e.key.substr(dot + 1);
  const auto* command = command_named(app, name);
  if (command == nullptr) {
    return fmt::format("'{}' is no command of actorpipe: the keys of a run go under [train], or "
                       "as train.KEY",
                       name);
  }
  if (flag_of(*command, key) == nullptr) {
    return fmt::format("'{}' is no flag of actorpipe {}{}", key, name, nearest(*command, key));
  }
  return std::nullopt;
}

// "a whole number" for an INT flag: the type as a person says it.
std::string what_it_takes(const CLI::Option& option) {
  auto type = option.get_type_name();
  auto kind = type.substr(0, type.find(':'));
  std::string said = kind == "INT"                    ? "a whole number"
                     : kind == "UINT"                 ? "a whole number, 0 or more"
                     : kind == "FLOAT"                ? "a number"
                     : kind == "TEXT"                 ? "text (in quotes)"
                     : option.get_expected_min() == 0 ? "true or false"
                                                      : kind;
  auto set = type.find('{');
  if (set != std::string::npos) {
    said = "one of " + type.substr(set);
  }
  return said;
}

} // namespace

std::optional<std::string> config_path(const std::vector<std::string>& args) {
  for (std::size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--config" && i + 1 < args.size()) {
      return args[i + 1];
    }
    if (args[i].rfind("--config=", 0) == 0) {
      return args[i].substr(9);
    }
  }
  return std::nullopt;
}

std::optional<std::string> explain_config_error(const CLI::App& app, const std::string& path,
                                                const CLI::ParseError& error) {
  std::ifstream in(path);
  if (!in) {
    return std::nullopt;
  }
  auto entries = entries_of(in);
  for (const auto& e : entries) {
    if (auto why = misplaced(app, e)) {
      return fmt::format("{}:{}: {}", path, e.line, *why);
    }
  }
  // A value the flag does not take: CLI11 names the flag ("Could not convert: --steps = two").
  static const std::regex flag(R"(--([a-z0-9][a-z0-9-]*))");
  std::smatch m;
  std::string what = error.what();
  if (!std::regex_search(what, m, flag)) {
    return std::nullopt;
  }
  for (const auto& e : entries) {
    auto dot = e.key.find('.');
    const auto* command =
      dot == std::string::npos ? &app : command_named(app, e.key.substr(0, dot));
    auto key = dot == std::string::npos ? e.key : e.key.substr(dot + 1);
    const auto* option = command == nullptr ? nullptr : flag_of(*command, key);
    auto value = e.value.size() >= 2 && (e.value.front() == '"' || e.value.front() == '\'')
                   ? e.value.substr(1, e.value.size() - 2)
                   : e.value;
    if (key == m[1] && option != nullptr && what.find(value) != std::string::npos) {
      return fmt::format("{}:{}: {} = {}: --{} takes {} ({})", path, e.line, e.key, e.value, key,
                         what_it_takes(*option), what);
    }
  }
  return std::nullopt;
}

} // namespace actorpipe::cli
