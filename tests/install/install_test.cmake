# cmake -DBUILD_DIR=... -DSOURCE_DIR=... -DWORK_DIR=... -P install_test.cmake
cmake_minimum_required(VERSION 3.16)
file(REMOVE_RECURSE ${WORK_DIR})
set(prefix ${WORK_DIR}/prefix)

function(run_step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (${rc}):\n${out}\n${err}")
  endif()
  message(STATUS "${what}: ok\n${out}")
endfunction()

run_step("install" ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
foreach(file include/actorpipe/actorpipe.hpp lib/cmake/ActorPipe/ActorPipeConfig.cmake bin/actorpipe)
  if(NOT EXISTS ${prefix}/${file})
    message(FATAL_ERROR "install did not put ${file} into ${prefix}")
  endif()
endforeach()
# The Python package, where that Python finds it under the prefix: it imports and trains.
if(PYTHON_DIR)
  set(script "import torch, actorpipe
m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
p = actorpipe.Pipeline(m, stages=2, microbatches=2)
loss = p.train_step(torch.randn(6, 4), torch.randn(6, 2))
assert loss > 0, loss
print('installed actorpipe trains:', loss, actorpipe.__file__)")
  run_step("the installed Python package" ${CMAKE_COMMAND} -E env
    PYTHONPATH=${prefix}/${PYTHON_DIR} PYTHONDONTWRITEBYTECODE=1 ${PYTHON} -c "${script}")
endif()
find_program(CCACHE ccache)
set(launcher)
if(CCACHE)
  set(launcher -DCMAKE_CXX_COMPILER_LAUNCHER=${CCACHE})
endif()
include(${CMAKE_CURRENT_LIST_DIR}/doc_blocks.cmake)
# One build of the examples and the docs' blocks, side by side (-j2): each is an application of
# its own (its own project() and find_package(ActorPipe)), added as a subdirectory.
set(examples embed custom_model data_parallel distributed)
set(all_dir ${WORK_DIR}/all)
set(lists "cmake_minimum_required(VERSION 3.16)\nproject(actorpipe_install_test LANGUAGES CXX)\n")
foreach(example ${examples})
  string(APPEND lists "add_subdirectory(${SOURCE_DIR}/examples/${example} ${example})\n")
endforeach()
string(APPEND lists "add_subdirectory(${doc_dir} doc-blocks)\n")
file(MAKE_DIRECTORY ${all_dir})
file(WRITE ${all_dir}/CMakeLists.txt "${lists}")
string(REPLACE ";" "," names "${examples}")
run_step("configure examples/{${names}} and the docs' ${count} C++ blocks"
  ${CMAKE_COMMAND} -S ${all_dir} -B ${all_dir}/build -DCMAKE_BUILD_TYPE=Release
  -DCMAKE_PREFIX_PATH=${prefix} ${launcher})
run_step("build them" ${CMAKE_COMMAND} --build ${all_dir}/build -j2)
foreach(example ${examples})
  run_step("run examples/${example}" ${all_dir}/build/${example}/${example})
endforeach()
