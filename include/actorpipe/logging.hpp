/// \file
/// Log levels. actorpipe logs to stderr through spdlog (a private dependency): warnings and
/// errors by default; info adds what was built and met (pipelines, rendezvous, checkpoints),
/// debug adds every step, trace every action of every stage. ACTORPIPE_LOG_LEVEL in the
/// environment sets the starting level.
#pragma once

#include <string>

namespace actorpipe {

enum class log_level { trace, debug, info, warn, error, off };

/// Sets the level from now on, for every thread.
void set_log_level(log_level level);

log_level get_log_level();

/// "trace", "debug", "info", "warn", "error" or "off"; throws invalid_argument naming the
/// accepted names otherwise.
log_level parse_log_level(const std::string& name);

} // namespace actorpipe
