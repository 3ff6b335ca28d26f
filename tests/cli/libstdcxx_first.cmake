# PyTorch's wheels export parts of a statically linked libstdc++ (pytorch/pytorch#133437): a
# program whose NEEDED list names libtorch before libstdc++ binds std::filesystem to those copies
# and crashes. Fails unless PROGRAM's first NEEDED of libstdc++ and libtorch* is libstdc++.
#   cmake -DPROGRAM=path -DREADELF=path -P libstdcxx_first.cmake
execute_process(COMMAND ${READELF} -d ${PROGRAM} OUTPUT_VARIABLE dynamic RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${READELF} -d ${PROGRAM} failed (${rc})")
endif()
string(REGEX MATCHALL "\\(NEEDED\\)[^[]*\\[[^]]+\\]" entries "${dynamic}")
set(first "")
foreach(entry IN LISTS entries)
  string(REGEX REPLACE ".*\\[([^]]+)\\]" "\\1" name "${entry}")
  if(name MATCHES "^libstdc\\+\\+" OR name MATCHES "^libtorch" OR name MATCHES "^libc10")
    set(first "${name}")
    break()
  endif()
endforeach()
if(NOT first MATCHES "^libstdc\\+\\+")
  string(REGEX REPLACE "\\(NEEDED\\)[^[]*\\[([^]]+)\\]" "\\1" names "${entries}")
  message(FATAL_ERROR "${PROGRAM} needs '${first}' before libstdc++ (NEEDED: ${names}): it would "
                      "bind std::filesystem to libtorch's copies (CMakeLists.txt, "
                      "ACTORPIPE_LIBSTDCXX)")
endif()
message(STATUS "${PROGRAM}: libstdc++ comes before libtorch")
