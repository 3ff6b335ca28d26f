# actorpipe_module(NAME [PROGRAM] [TARGET T] [SOURCES ...] [HEADERS ...] [DEPENDS ...] [LINKS ...])
#
# Declares the library of one layer, actorpipe_NAME (static with SOURCES, else an interface
# library), and its include view ${ACTORPIPE_VIEWS}/NAME: a link NAME -> the folder NAME (its
# internal headers, included as "NAME/x.hpp") and a link actorpipe/H.hpp for each public header
# H the layer owns. The library compiles against its own view and the views of DEPENDS (layers
# below, linked PUBLIC so their views reach the layers above); it never sees the source tree,
# so an include of a higher layer's header finds no file. LINKS are other libraries the layer
# uses in its sources only (CAF, OpenSSL, ...). PROGRAM marks a layer of the programs (bench/,
# cli/): built here, not installed. TARGET names the library (default actorpipe_NAME).
function(actorpipe_module name)
  cmake_parse_arguments(M "PROGRAM" "TARGET" "SOURCES;HEADERS;DEPENDS;LINKS" ${ARGN})
  if(name STREQUAL "actorpipe")
    set(target actorpipe)
  elseif(M_TARGET)
    set(target ${M_TARGET})
  else()
    set(target actorpipe_${name})
  endif()
  set(view ${ACTORPIPE_VIEWS}/${name})
  file(REMOVE_RECURSE ${view})
  file(MAKE_DIRECTORY ${view}/actorpipe)
  if(IS_DIRECTORY ${PROJECT_SOURCE_DIR}/${name})
    file(CREATE_LINK ${PROJECT_SOURCE_DIR}/${name} ${view}/${name} SYMBOLIC)
  endif()
  foreach(header ${M_HEADERS})
    set(file ${PROJECT_SOURCE_DIR}/include/actorpipe/${header}.hpp)
    if(NOT EXISTS ${file})
      message(FATAL_ERROR "actorpipe_module(${name}): no public header ${file}")
    endif()
    file(CREATE_LINK ${file} ${view}/actorpipe/${header}.hpp SYMBOLIC)
  endforeach()
  if(M_SOURCES)
    add_library(${target} STATIC ${M_SOURCES})
    target_include_directories(${target} PUBLIC $<BUILD_INTERFACE:${view}>
                                                $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
    target_link_libraries(${target} PUBLIC ${M_DEPENDS} PRIVATE ${M_LINKS}
                                                         $<BUILD_INTERFACE:actorpipe_build>)
    target_precompile_headers(${target} REUSE_FROM actorpipe_pch)
  else()
    add_library(${target} INTERFACE)
    target_include_directories(${target} INTERFACE $<BUILD_INTERFACE:${view}>
                                                   $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
    target_link_libraries(${target} INTERFACE ${M_DEPENDS})
  endif()
  if(NOT M_PROGRAM)
    set_target_properties(${target} PROPERTIES EXPORT_NAME ${name})
    set_property(GLOBAL APPEND PROPERTY ACTORPIPE_MODULES ${target})
  endif()
endfunction()
