/// \file
/// A `--config` file's mistakes in the file's own terms: which file, which line, which key, where
/// the key goes and what its value must be. CLI11 reads the file (CLI::ConfigTOML) but says
/// neither the file nor the line ("INI was not able to parse data"); this reads the file again
/// after a parse error and names them.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace actorpipe::cli {

/// The `--config` path on a command line (`--config F` or `--config=F`), if there is one.
std::optional<std::string> config_path(const std::vector<std::string>& args);

/// Why `error`, thrown while parsing with the config file at `path`, comes from that file, as
/// "FILE:LINE: ..." naming the key and, for a key in the wrong place, where it goes, or for a
/// value of the wrong type, what the flag takes. Nothing when the file does not explain it (the
/// mistake is on the command line, or the file cannot be read: CLI11's words say it then).
std::optional<std::string> explain_config_error(const CLI::App& app, const std::string& path,
                                                const CLI::ParseError& error);

} // namespace actorpipe::cli
