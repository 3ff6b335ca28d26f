# cmake -DBUILD_DIR=... -P check_architecture.cmake: the layer order and the typed protocols, one
# check after the other. They build targets of one build tree, which two makes at once would race
# on (the precompiled header first), so they are one test rather than two.
include(${CMAKE_CURRENT_LIST_DIR}/check_layers.cmake)
include(${CMAKE_CURRENT_LIST_DIR}/check_protocols.cmake)
