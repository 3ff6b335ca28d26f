// actorpipe: pipeline-parallel training on the actor model.
#include "cli/program.hpp"

int main(int argc, char** argv) {
  actorpipe::cli::program program;
  try {
    program.app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version exit 0; every bad flag exits 2 (docs/troubleshooting.md).
    return program.app.exit(e) == 0 ? 0 : 2;
  }
  return program.run();
}
