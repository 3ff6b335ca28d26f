# Helpers of the architecture checks (cmake -P scripts given -DBUILD_DIR=...): build a target of
# the build tree, and require one to build or to fail for a given reason.
function(build target result output)
  execute_process(COMMAND ${CMAKE_COMMAND} --build ${BUILD_DIR} --target ${target}
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  set(${result} ${rc} PARENT_SCOPE)
  set(${output} "${out}${err}" PARENT_SCOPE)
endfunction()

# `target` must build; `what` says what it shows.
function(expect_build target what)
  build(${target} rc out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} did not build:\n${out}")
  endif()
  message(STATUS "${what} builds")
endfunction()

# `target` must fail to build, with `reason` in the compiler's output.
function(expect_build_failure target reason)
  build(${target} rc out)
  if(rc EQUAL 0)
    message(FATAL_ERROR "${target} built, but it must not ('${reason}')")
  endif()
  string(FIND "${out}" "${reason}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "${target} failed, but not with '${reason}':\n${out}")
  endif()
  message(STATUS "${target} does not build: ${reason}")
endfunction()
