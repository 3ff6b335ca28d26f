// Against the order: stages/ may not include the engine's facade (a layer above it).
#include <actorpipe/pipeline.hpp>

#include "stages/stage.hpp"

int stages_includes_engine() {
  return 0;
}
