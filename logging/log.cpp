#include "logging/log.hpp"

#include <cstdlib>

#include <spdlog/sinks/stdout_color_sinks.h>

#include <actorpipe/errors.hpp>
#include <actorpipe/logging.hpp>

namespace actorpipe {
namespace {

// log_level's values follow spdlog's order: trace, debug, info, warn, error, (critical), off.
spdlog::level::level_enum to_spdlog(log_level level) {
  return level == log_level::off ? spdlog::level::off
                                 : static_cast<spdlog::level::level_enum>(level);
}

} // namespace

namespace log {

const std::shared_ptr<spdlog::logger>& get() {
  static const std::shared_ptr<spdlog::logger> logger = [] {
    auto l = std::make_shared<spdlog::logger>(
      "actorpipe", std::make_shared<spdlog::sinks::stderr_color_sink_mt>());
    l->set_pattern("[%H:%M:%S.%e] [%^%l%$] actorpipe: %v");
    l->set_level(spdlog::level::warn);
    if (const char* env = std::getenv("ACTORPIPE_LOG_LEVEL"); env && *env) {
      try {
        l->set_level(to_spdlog(parse_log_level(env)));
      } catch (const invalid_argument& e) {
        l->warn("ACTORPIPE_LOG_LEVEL: {}", e.what());
      }
    }
    l->flush_on(spdlog::level::warn);
    return l;
  }();
  return logger;
}

} // namespace log

static_assert(static_cast<int>(log_level::error) == spdlog::level::err);

void set_log_level(log_level level) {
  log::get()->set_level(to_spdlog(level));
}

log_level get_log_level() {
  auto l = log::get()->level();
  return l >= spdlog::level::critical ? log_level::off : static_cast<log_level>(l);
}

log_level parse_log_level(const std::string& name) {
  static const char* names[] = {"trace", "debug", "info", "warn", "error", "off"};
  for (int i = 0; i < 6; ++i) {
    if (name == names[i]) {
      return static_cast<log_level>(i);
    }
  }
  throw invalid_argument(
    detail::concat("unknown log level '", name, "' (known: trace, debug, info, warn, error, off)"));
}

} // namespace actorpipe
