# cmake -DBUILD_DIR=... -P check_layers.cmake: the file with allowed includes builds, each file
# with an include against the layer order fails for want of that header.
function(build target result output)
  execute_process(COMMAND ${CMAKE_COMMAND} --build ${BUILD_DIR} --target ${target}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  set(${result} ${rc} PARENT_SCOPE)
  set(${output} "${out}${err}" PARENT_SCOPE)
endfunction()

build(layering_allowed_stages rc out)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "stages/ with allowed includes did not build:\n${out}")
endif()
message(STATUS "allowed includes of stages/ build")

foreach(case "layering_violation_stages;actorpipe/pipeline.hpp"
             "layering_violation_actors;scheduler/scheduler_actor.hpp")
  list(GET case 0 target)
  list(GET case 1 header)
  build(${target} rc out)
  if(rc EQUAL 0)
    message(FATAL_ERROR "${target} built, but it includes ${header} against the layer order")
  endif()
  string(FIND "${out}" "${header}: No such file or directory" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "${target} failed, but not for want of ${header}:\n${out}")
  endif()
  message(STATUS "${target}: ${header} is out of reach, as it must be")
endforeach()
