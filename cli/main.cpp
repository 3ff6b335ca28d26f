// actorpipe: pipeline-parallel training on the actor model.
#include <iostream>

#include "cli/config_file.hpp"
#include "cli/program.hpp"

int main(int argc, char** argv) {
  actorpipe::cli::program program;
  try {
    program.app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // A --config file's mistake is said with the file, the line and the key.
    auto path = actorpipe::cli::config_path({argv + 1, argv + argc});
    auto why = path ? actorpipe::cli::explain_config_error(program.app, *path, e) : std::nullopt;
    if (why && e.get_exit_code() != 0) {
      std::cerr << "actorpipe: error: " << *why << '\n';
      return 2;
    }
    // --help and --version exit 0; every bad flag exits 2 (docs/troubleshooting.md).
    return program.app.exit(e) == 0 ? 0 : 2;
  }
  return program.run();
}
