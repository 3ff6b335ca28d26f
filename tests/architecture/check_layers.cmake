# cmake -DBUILD_DIR=... -P check_layers.cmake: the file with allowed includes builds, each file
# with an include against the layer order fails for want of that header.
include(${CMAKE_CURRENT_LIST_DIR}/build_checks.cmake)

expect_build(layering_allowed_stages "stages/ with allowed includes")
expect_build_failure(layering_violation_stages "actorpipe/pipeline.hpp: No such file or directory")
expect_build_failure(layering_violation_actors
                     "scheduler/scheduler_actor.hpp: No such file or directory")
