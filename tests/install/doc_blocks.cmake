# Included by install_test.cmake: every ```cpp block of README.md and docs/*.md, written as a
# project (${doc_dir}) that install_test.cmake compiles against the installed package as an
# application would. A block is a snippet: its #include lines go to
# the top of the file, the rest into a function of its own whose parameters are the names the
# docs use without declaring them (sys, layers, x, y, ...). #line directives make a compile error
# name the Markdown file and line.
set(doc_dir ${WORK_DIR}/doc-blocks)
file(MAKE_DIRECTORY ${doc_dir})
set(includes "#include <actorpipe/actorpipe.hpp>\n#include <torch/torch.h>\n")
set(bodies "")
set(count 0)
file(GLOB doc_files ${SOURCE_DIR}/docs/*.md)
foreach(doc ${SOURCE_DIR}/README.md ${doc_files})
  file(READ ${doc} text)
  file(RELATIVE_PATH name ${SOURCE_DIR} ${doc})
  set(offset 0)
  while(TRUE)
    string(SUBSTRING "${text}" ${offset} -1 rest)
    string(FIND "${rest}" "```cpp\n" start)
    if(start EQUAL -1)
      break()
    endif()
    math(EXPR body_start "${offset} + ${start} + 7")
    string(SUBSTRING "${text}" ${body_start} -1 rest)
    string(FIND "${rest}" "```" length)
    if(length EQUAL -1)
      message(FATAL_ERROR "${name}: a ```cpp block is not closed")
    endif()
    string(SUBSTRING "${text}" ${body_start} ${length} block)
    # The block's first line: count the newlines before it.
    string(SUBSTRING "${text}" 0 ${body_start} before)
    string(REGEX MATCHALL "\n" newlines "${before}")
    list(LENGTH newlines line)
    math(EXPR line "${line} + 1")
    # Hoist the #include lines (blanked in place, so that line numbers stay right).
    string(REGEX MATCHALL "#include [^\n]*" block_includes "${block}")
    foreach(include_line ${block_includes})
      string(APPEND includes "${include_line}\n")
    endforeach()
    string(REGEX REPLACE "#include [^\n]*" "" block "${block}")
    math(EXPR count "${count} + 1")
    string(APPEND bodies
      "[[maybe_unused]] void block_${count}(actorpipe::engine& sys, actorpipe::pipeline& pipe,\n"
      "    actorpipe::layer_list layers,\n"
      "    torch::Tensor x, torch::Tensor y, std::string secret, int64_t n, uint64_t seed,\n"
      "    int64_t epoch, int64_t rank, int64_t world_size) {\n"
      "  {\n#line ${line} \"${name}\"\n${block}\n  }\n}\n\n")
    math(EXPR offset "${body_start} + ${length} + 3")
  endwhile()
endforeach()
if(count EQUAL 0)
  message(FATAL_ERROR "no ```cpp blocks found in README.md and docs/")
endif()
file(WRITE ${doc_dir}/doc_blocks.cpp "${includes}\n${bodies}")
file(WRITE ${doc_dir}/CMakeLists.txt "cmake_minimum_required(VERSION 3.16)
project(actorpipe_doc_blocks LANGUAGES CXX)
set(CMAKE_CXX_STANDARD 17)
find_package(ActorPipe REQUIRED)
add_library(doc_blocks OBJECT doc_blocks.cpp)
target_link_libraries(doc_blocks PRIVATE actorpipe::actorpipe)
")
