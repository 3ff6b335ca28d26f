/// \file
/// The library's logger (internal): `log::get()->info("...{}...", value)`.
#pragma once

#include <memory>

#include <spdlog/logger.h>

namespace actorpipe::log {

/// The "actorpipe" logger, writing to stderr; created on first use at ACTORPIPE_LOG_LEVEL (or
/// warn).
const std::shared_ptr<spdlog::logger>& get();

} // namespace actorpipe::log
