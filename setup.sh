#!/usr/bin/env bash
# actorpipe set-up: installs what is missing (Debian 12, as root), builds, then
#   ./setup.sh run [train flags...]   runs the main job (`actorpipe train` with defaults)
#   ./setup.sh test                   runs the whole test suite through CTest
#   ./setup.sh build                  only builds
set -euo pipefail
cd "$(dirname "$0")"

packages=(
  build-essential cmake ccache clang-format
  libtorch-dev            # libtorch 1.13 (CPU), with c10d Gloo
  libgloo-dev             # headers of Gloo, which c10d's ProcessGroupGloo.hpp includes
  libopenblas0-openmp     # without it Debian's libtorch falls back to the reference BLAS
  libcaf-dev              # C++ Actor Framework 0.17
  libboost-dev            # Boost.Asio
  libcli11-dev nlohmann-json3-dev libspdlog-dev doctest-dev zlib1g-dev libbenchmark-dev
  dataset-fashion-mnist   # the real data of the main job
)

install_missing() {
  local missing=()
  for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    echo "setup: installing ${missing[*]}"
    local sudo=""
    [[ $(id -u) -eq 0 ]] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
  fi
}

build() {
  cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
  cmake --build build -j"$(nproc)"
}

command=${1:-run}
shift || true
install_missing
build
case "$command" in
  run) exec build/cli/actorpipe train "$@" ;;
  test) cd build && exec ctest -j2 --output-on-failure --timeout 600 "$@" ;;
  build) ;;
  *) echo "usage: ./setup.sh run|test|build [args...]" >&2; exit 2 ;;
esac
