// The precompiled header is built with this empty translation unit (CMakeLists.txt).
