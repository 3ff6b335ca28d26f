// Allowed: stages/ uses the vocabulary and its own headers (the control for the two files
// beside it, which must not build).
#include <actorpipe/options.hpp>

#include "stages/stage.hpp"

int stages_uses_vocabulary() {
  return actorpipe::pipeline_options{}.microbatches == 1 ? 0 : 1;
}
