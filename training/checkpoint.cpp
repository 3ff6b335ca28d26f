#include <actorpipe/training.hpp>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "logging/log.hpp"
#include "stages/checkpoint.hpp"

namespace actorpipe {
namespace fs = std::filesystem;

namespace {

constexpr const char* manifest_format = "actorpipe-checkpoint-1";

// Writes `text` to `file`; an error naming it when that fails (disk_full where there is no room).
void write_text(const fs::path& file, const std::string& text) {
  stages::write_bytes(file.string(), text.data(), text.size());
}

// Test hook: ACTORPIPE_FAULT=checkpoint-before-rename kills the process (SIGKILL, as kill -9)
// after a checkpoint's files are written but before it is published.
void maybe_die(const char* point) {
  const char* fault = std::getenv("ACTORPIPE_FAULT");
  if (fault != nullptr && std::string(fault) == point) {
    std::raise(SIGKILL);
  }
}

std::vector<std::pair<uint64_t, fs::path>> checkpoints_in(const fs::path& root) {
  std::vector<std::pair<uint64_t, fs::path>> found;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    auto name = entry.path().filename().string();
    if (name.rfind("step-", 0) != 0 || !fs::exists(entry.path() / "manifest.json")) {
      continue;
    }
    try {
      found.emplace_back(std::stoull(name.substr(5)), entry.path());
    } catch (const std::exception&) {
      // Not one of ours.
    }
  }
  std::sort(found.begin(), found.end());
  return found;
}

} // namespace

std::string write_checkpoint(pipeline& pipe, const std::string& root,
                             const checkpoint_manifest& manifest, std::size_t keep) {
  ACTORPIPE_CHECK(keep >= 1, "checkpoints to keep (", keep, ") must be >= 1");
  fs::path dir = fs::path(root) / detail::concat("step-", manifest.step);
  fs::path tmp = fs::path(root) / detail::concat(".tmp-step-", manifest.step);
  std::error_code ec;
  fs::create_directories(root, ec);
  fs::remove_all(tmp, ec);
  try {
    pipe.save_state(tmp.string());
    nlohmann::json j{{"format", manifest_format},   {"model", manifest.model},
                     {"bounds", manifest.bounds},   {"step", manifest.step},
                     {"epoch", manifest.epoch},     {"batch_in_epoch", manifest.batch_in_epoch},
                     {"seed", manifest.seed},       {"batch_size", manifest.batch_size},
                     {"dataset", manifest.dataset}, {"stage_files", pipe.stages()}};
    if (!manifest.settings.empty()) {
      write_text(tmp / "run.toml", manifest.settings);
    }
    write_text(tmp / "manifest.json", j.dump(2) + "\n");
  } catch (...) {
    // What the failed write took goes back to a disk that may be full; the checkpoints written
    // before stay as they were.
    fs::remove_all(tmp, ec);
    throw;
  }
  maybe_die("checkpoint-before-rename");
  fs::remove_all(dir, ec);
  fs::rename(tmp, dir, ec);
  if (ec) {
    throw pipeline_error(
      detail::concat("cannot publish checkpoint '", dir.string(), "': ", ec.message()),
      error_details{error_kind::io});
  }
  auto all = checkpoints_in(root);
  for (std::size_t i = 0; i + keep < all.size(); ++i) {
    fs::remove_all(all[i].second, ec);
  }
  // Leftovers of writes that died before their rename.
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    if (entry.path().filename().string().rfind(".tmp-step-", 0) == 0) {
      fs::remove_all(entry.path(), ec);
    }
  }
  log::get()->info("checkpoint of step {} written to {}", manifest.step, dir.string());
  return dir.string();
}

std::string find_checkpoint(const std::string& path) {
  if (fs::exists(fs::path(path) / "manifest.json")) {
    return path;
  }
  auto all = checkpoints_in(path);
  ACTORPIPE_CHECK(!all.empty(), "no checkpoint in '", path,
                  "': expected a folder with manifest.json or step-N folders holding one");
  return all.back().second.string();
}

checkpoint_manifest read_manifest(const std::string& dir) {
  auto file = (fs::path(dir) / "manifest.json").string();
  std::ifstream in(file);
  if (!in) {
    throw pipeline_error(detail::concat("cannot read '", file, "'"), error_details{error_kind::io});
  }
  try {
    auto j = nlohmann::json::parse(in);
    if (j.at("format") != manifest_format) {
      throw pipeline_error(
        detail::concat("'", file, "': format ", j.at("format").dump(), " is not ", manifest_format),
        error_details{error_kind::io});
    }
    checkpoint_manifest m;
    m.model = j.at("model").get<std::string>();
    m.bounds = j.at("bounds").get<std::vector<std::size_t>>();
    m.step = j.at("step").get<uint64_t>();
    m.epoch = j.at("epoch").get<int64_t>();
    m.batch_in_epoch = j.at("batch_in_epoch").get<int64_t>();
    m.seed = j.at("seed").get<uint64_t>();
    m.batch_size = j.at("batch_size").get<int64_t>();
    m.dataset = j.at("dataset").get<std::string>();
    std::ifstream settings(fs::path(dir) / "run.toml");
    m.settings.assign(std::istreambuf_iterator<char>(settings), std::istreambuf_iterator<char>());
    return m;
  } catch (const nlohmann::json::exception& e) {
    throw pipeline_error(detail::concat("'", file, "' is not a valid manifest: ", e.what()),
                         error_details{error_kind::io});
  }
}

namespace {

// key -> value of the `key=value` lines of TOML text, blanks, sections and other comments
// skipped. A commented `# key=value` is a default (--print-config writes defaults so) and counts.
std::map<std::string, std::string> settings_lines(const std::string& text) {
  auto trim = [](const std::string& s) {
    auto b = s.find_first_not_of(" \t");
    auto e = s.find_last_not_of(" \t\r");
    return b == std::string::npos ? std::string{} : s.substr(b, e - b + 1);
  };
  std::map<std::string, std::string> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("# ", 0) == 0 && line.find('=') != std::string::npos &&
        line.find(' ', 2) > line.find('=')) {
      line = line.substr(2);
    }
    auto eq = line.find('=');
    if (line.empty() || line[0] == '#' || line[0] == '[' || eq == std::string::npos) {
      continue;
    }
    out[trim(line.substr(0, eq))] = trim(line.substr(eq + 1));
  }
  return out;
}

} // namespace

std::vector<std::string> settings_differences(const std::string& before, const std::string& now,
                                              const std::vector<std::string>& ignored) {
  auto a = settings_lines(before);
  auto b = settings_lines(now);
  std::set<std::string> keys;
  for (const auto& [k, v] : a) {
    keys.insert(k);
  }
  for (const auto& [k, v] : b) {
    keys.insert(k);
  }
  std::vector<std::string> out;
  for (const auto& k : keys) {
    if (std::find(ignored.begin(), ignored.end(), k) != ignored.end()) {
      continue;
    }
    auto x = a.count(k) != 0 ? a[k] : std::string("(none)");
    auto y = b.count(k) != 0 ? b[k] : std::string("(none)");
    if (x != y) {
      out.push_back(detail::concat(k, ": ", x, " -> ", y));
    }
  }
  return out;
}

} // namespace actorpipe
