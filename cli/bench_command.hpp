/// \file
/// `actorpipe bench`: the split-size sweep against plain libtorch (see bench/sweep.hpp).
#pragma once

#include "bench/sweep.hpp"

namespace CLI {
class App;
}

namespace actorpipe::cli {

CLI::App* add_bench_command(CLI::App& app, bench::sweep_options& options);

} // namespace actorpipe::cli
