# Under `pip install .` (pyproject.toml sets ACTORPIPE_TORCH_FROM_PYTHON): the build is pointed at
# the torch installed in the Python that pip runs, whatever its version (2.11 or newer) and build
# (CPU or CUDA), so that the extension and the program use the libtorch that will import them.
#
# pip's build isolation hides that environment's packages from Python through PYTHONPATH (a
# sitecustomize of its own) and PYTHONNOUSERSITE, not from the interpreter: where torch does not
# import as the build runs, it is asked again with those two unset. Sets ACTORPIPE_PYTHON, the
# search paths find_package(Torch) uses, ACTORPIPE_SCRIPTS_DIR (where the program is found once
# installed) and, unless given, ACTORPIPE_WITH_CUDA / ACTORPIPE_WITH_NCCL by the rule below.
function(actorpipe_torch_of_python)
  set(python "${Python_EXECUTABLE}")  # scikit-build-core passes the interpreter pip runs
  if(NOT python)
    set(python "${Python3_EXECUTABLE}")
  endif()
  if(NOT python)
    find_program(python NAMES python3 python REQUIRED)
  endif()
  set(probe "${CMAKE_CURRENT_LIST_DIR}/torch_of_python.py")
  execute_process(COMMAND "${python}" "${probe}" RESULT_VARIABLE rc OUTPUT_VARIABLE out
                  ERROR_VARIABLE err)
  if(rc EQUAL 3)
    execute_process(COMMAND ${CMAKE_COMMAND} -E env --unset=PYTHONPATH --unset=PYTHONNOUSERSITE
                            "${python}" "${probe}"
                    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  endif()
  if(rc EQUAL 3)
    message(FATAL_ERROR "actorpipe builds against the torch of the Python it is installed into, and "
      "${python} has none: install torch 2.11 or newer there first (pip install torch), then pip "
      "install . again (uv: uv pip install --no-build-isolation .).")
  elseif(NOT rc EQUAL 0)
    message(FATAL_ERROR "import torch failed in ${python}, which actorpipe is built for:\n${err}")
  endif()
  string(REPLACE "\n" ";" lines "${out}")
  list(GET lines 0 torch_version)
  list(GET lines 1 torch_cmake_dir)
  list(GET lines 2 torch_lib_dir)
  list(GET lines 3 torch_cuda)
  list(GET lines 4 scripts_dir)
  string(REGEX MATCH "^[0-9]+\\.[0-9]+" torch_minor "${torch_version}")
  if(torch_minor VERSION_LESS 2.11)
    message(FATAL_ERROR "actorpipe's pip build needs torch 2.11 or newer, and ${python} has torch "
      "${torch_version}: pip install -U torch there (Debian's libtorch 1.13 builds with ./setup.sh).")
  endif()

  # A build folder used before with another torch forgets what it found there.
  if(ACTORPIPE_TORCH_SEEN AND NOT ACTORPIPE_TORCH_SEEN STREQUAL torch_lib_dir)
    get_filename_component(old_prefix "${ACTORPIPE_TORCH_SEEN}/../.." ABSOLUTE)
    get_cmake_property(cached CACHE_VARIABLES)
    foreach(var ${cached})
      get_property(value CACHE ${var} PROPERTY VALUE)
      if(value MATCHES "^${old_prefix}/" OR var STREQUAL "Torch_DIR" OR var STREQUAL "Caffe2_DIR")
        unset(${var} CACHE)
      endif()
    endforeach()
  endif()
  set(ACTORPIPE_TORCH_SEEN "${torch_lib_dir}" CACHE INTERNAL "The torch this build folder uses")

  set(ACTORPIPE_PYTHON "${python}" CACHE FILEPATH "The Python whose torch actorpipe is built for" FORCE)
  set(ACTORPIPE_SCRIPTS_DIR "${scripts_dir}" CACHE INTERNAL "Where pip puts the program")
  set(CMAKE_PREFIX_PATH "${torch_cmake_dir};${CMAKE_PREFIX_PATH}" PARENT_SCOPE)
  set(CMAKE_LIBRARY_PATH "${torch_lib_dir};${CMAKE_LIBRARY_PATH}" PARENT_SCOPE)

  set(actorpipe_torch_version "${torch_version}" PARENT_SCOPE)
  set(actorpipe_torch_cuda "${torch_cuda}" PARENT_SCOPE)
  message(STATUS "actorpipe: built for torch ${torch_version} of ${python}")
endfunction()

# CUDA: the engine binds stages to GPUs where the wheel is a CUDA build and the CUDA toolkit here
# has the wheel's major version (torch's CMake config compiles against the toolkit's headers and
# links the wheel's libraries); otherwise the CPU engine, said here and by `import actorpipe` on a
# machine with a GPU (actorpipe.build_info["cuda_reason"]). Sets ACTORPIPE_WITH_CUDA,
# ACTORPIPE_WITH_NCCL and ACTORPIPE_CUDA_REASON, unless -DACTORPIPE_WITH_CUDA=ON|OFF is given
# (-C cmake.define.ACTORPIPE_WITH_CUDA=OFF through pip). A CUDA wheel without any toolkit is
# refused: torch's own config cannot be used then.
function(actorpipe_cuda_for_torch torch_version torch_cuda)
  set(cuda_reason "")
  if(torch_cuda STREQUAL "")
    set(cuda_reason "torch ${torch_version} is a CPU build")
  else()
    find_program(ACTORPIPE_NVCC nvcc HINTS ENV CUDA_HOME ENV CUDA_PATH PATH_SUFFIXES bin
                 PATHS /usr/local/cuda/bin)
    set(toolkit "")
    if(ACTORPIPE_NVCC)
      execute_process(COMMAND "${ACTORPIPE_NVCC}" --version OUTPUT_VARIABLE nvcc_out)
      string(REGEX MATCH "release ([0-9]+\\.[0-9]+)" _ "${nvcc_out}")
      set(toolkit "${CMAKE_MATCH_1}")
    endif()
    string(REGEX MATCH "^[0-9]+" wheel_major "${torch_cuda}")
    string(REGEX MATCH "^[0-9]+" toolkit_major "${toolkit}")
    if(toolkit STREQUAL "")
      # torch's own CMake config (Caffe2's cuda.cmake) enables CUDA and fails without a toolkit,
      # whatever this build would do with it: said here in our words first.
      message(FATAL_ERROR "torch ${torch_version} is a CUDA build, and torch's CMake config needs "
        "a CUDA ${wheel_major} toolkit (nvcc) to build anything against it, which this machine "
        "lacks: install one (CUDA_HOME names where), or PyTorch's CPU wheel (pip install torch "
        "--index-url https://download.pytorch.org/whl/cpu), then pip install . again.")
    elseif(NOT toolkit_major STREQUAL wheel_major)
      string(CONCAT cuda_reason "torch ${torch_version} is built with CUDA ${torch_cuda}, and the "
                    "CUDA toolkit here is ${toolkit} (${ACTORPIPE_NVCC})")
    endif()
  endif()
  if(DEFINED ACTORPIPE_WITH_CUDA)  # given: -DACTORPIPE_WITH_CUDA=ON|OFF decides
    return()
  endif()
  set(ACTORPIPE_CUDA_REASON "${cuda_reason}" PARENT_SCOPE)
  if(NOT cuda_reason STREQUAL "")
    set(ACTORPIPE_WITH_CUDA OFF PARENT_SCOPE)
    message(WARNING "actorpipe: the CPU engine: ${cuda_reason}.")
    return()
  endif()
  set(ACTORPIPE_WITH_CUDA ON PARENT_SCOPE)
  find_path(ACTORPIPE_NCCL_HEADER nccl.h HINTS "${ACTORPIPE_NVCC}/../../include"
            PATHS /usr/local/cuda/include /usr/local/include /usr/include)
  if(ACTORPIPE_NCCL_HEADER)
    set(ACTORPIPE_WITH_NCCL ON PARENT_SCOPE)
  else()
    message(WARNING "actorpipe: no nccl.h beside the CUDA toolkit: replicas on GPUs need NCCL "
                    "(its -dev package), and this build has none")
  endif()
endfunction()

if(ACTORPIPE_TORCH_FROM_PYTHON)
  actorpipe_torch_of_python()
  actorpipe_cuda_for_torch("${actorpipe_torch_version}" "${actorpipe_torch_cuda}")
endif()
