# FindStb: locates Sean Barrett's stb libraries as Debian ships them (libstb-dev: the headers in
# <stb/...> and libstb.so holding their implementations), which install no CMake package
# configuration. Defines Stb::Stb and Stb_FOUND.
find_path(STB_INCLUDE_DIR NAMES stb/stb_image.h)
find_library(STB_LIBRARY NAMES stb)

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(Stb REQUIRED_VARS STB_INCLUDE_DIR STB_LIBRARY)

if(Stb_FOUND AND NOT TARGET Stb::Stb)
  add_library(Stb::Stb UNKNOWN IMPORTED)
  set_target_properties(Stb::Stb PROPERTIES
    IMPORTED_LOCATION "${STB_LIBRARY}"
    INTERFACE_SYSTEM_INCLUDE_DIRECTORIES "${STB_INCLUDE_DIR}")
endif()
mark_as_advanced(STB_INCLUDE_DIR STB_LIBRARY)
