#!/bin/sh
# A Python with no packages of its own (no site folders, so no torch): the interpreter of a
# fresh environment, for the pip build's refusal (tests/CMakeLists.txt).
exec "${ACTORPIPE_REAL_PYTHON:-python3}" -S "$@"
