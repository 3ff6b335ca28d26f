// Against the order: actors/ may not include the scheduler (a layer above it).
#include "actors/stage_actor.hpp"
#include "scheduler/scheduler_actor.hpp"

int actors_includes_scheduler() {
  return 0;
}
