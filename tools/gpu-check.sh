#!/usr/bin/env bash
# The GPU check on a machine with a GPU and PyTorch but no network and none of Debian's packages
# (docs/gpu.md):
#
#   tools/gpu-check.sh gather        on a connected Debian 12 machine: downloads the Debian packages
#                                    the build needs (apt-get download) and a cmake wheel into
#                                    .gpu-debs/ (ignored by git; about 45 MB)
#   tools/gpu-check.sh run OUT       on the GPU machine, from the tree's root with .gpu-debs/ beside
#                                    it: unpacks the packages into .gpu-root/, builds against that
#                                    machine's own torch with every core (build-gpu/), runs the GPU
#                                    tests and the GPU bench, and writes logs and results.json to OUT
#
# `run` needs python3 with a CUDA build of torch, g++, and cmake (or the gathered wheel). It
# reports every stage in OUT/results.json, also the ones that failed, and exits non-zero when one
# did. Meant to fit in 10 minutes on 16 cores.
set -uo pipefail
cd "$(dirname "$0")/.."

debs_dir=.gpu-debs
root=$PWD/.gpu-root
packages=(
  libcaf-dev libcaf-core0.17 libcaf-io0.17 libcaf-openssl0.17 # C++ Actor Framework 0.17
  libboost1.74-dev                                            # Boost.Asio
  libcli11-dev nlohmann-json3-dev doctest-dev libstb-dev libstb0
  libspdlog-dev libspdlog1.10 libfmt-dev libfmt9
  zlib1g-dev libssl-dev libssl3 # libssl3: what libssl-dev's links point to
)

gather() {
  set -e
  mkdir -p "$debs_dir"
  (cd "$debs_dir" && apt-get download "${packages[@]}")
  # cmake for a machine without it: a manylinux wheel (pure binary, any Python 3).
  python3 -m pip download --no-deps --only-binary=:all: --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --python-version 3.12 -d "$debs_dir" 'cmake<4' >/dev/null
  du -sh "$debs_dir"
}

log() { echo "gpu-check: $*" | tee -a "$out/gpu-check.log"; }

# Runs a named stage, its output to OUT/NAME.log; records its status and seconds.
declare -A status seconds
stage() {
  local name=$1
  shift
  local start=$SECONDS
  log "$name: $*"
  if "$@" >"$out/$name.log" 2>&1; then status[$name]=ok; else status[$name]="failed ($?)"; fi
  seconds[$name]=$((SECONDS - start))
  log "$name: ${status[$name]} after ${seconds[$name]} s"
}

unpack() {
  rm -rf "$root" && mkdir -p "$root"
  for deb in "$debs_dir"/*.deb; do
    if command -v dpkg-deb >/dev/null; then
      dpkg-deb -x "$deb" "$root"
    else
      local data
      data=$(ar t "$deb" | grep '^data.tar')
      ar p "$deb" "$data" | tar -x -C "$root" --auto-compress -f - 2>/dev/null ||
        ar p "$deb" "$data" | tar -xJ -C "$root"
    fi
  done
  if ! command -v cmake >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --target "$root/cmake-wheel" "$debs_dir"/cmake-*.whl
  fi
}

configure_and_build() {
  local torch_dir lib=$root/usr/lib/x86_64-linux-gnu
  torch_dir=$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))')
  cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DCMAKE_UNITY_BUILD=ON \
    -DCMAKE_UNITY_BUILD_BATCH_SIZE=4 -DACTORPIPE_WITH_CUDA=ON -DACTORPIPE_WITH_NCCL=ON \
    -DCMAKE_PREFIX_PATH="$torch_dir/share/cmake;$root/usr;$lib/cmake;$root/usr/share/cmake" \
    -DCMAKE_LIBRARY_PATH="$torch_dir/lib;$lib" -DCMAKE_INCLUDE_PATH="$root/usr/include" \
    -DCMAKE_CXX_FLAGS="-isystem $root/usr/include" \
    -DCMAKE_EXE_LINKER_FLAGS="-L$lib -Wl,-rpath,$lib" -DACTORPIPE_PYTHON="$(command -v python3)" &&
    cmake --build build-gpu -j"$(nproc)" --target actorpipe_cli gpu_test pipeline_test \
      actorpipe_gpu_bench
}

gpu_tests() {
  (cd build-gpu && ctest -L gpu --output-on-failure --timeout 300)
}

cpu_tests() {
  (cd build-gpu && ctest -j8 --output-on-failure --timeout 300 \
    -E '_NOT_BUILT|nodes_across|example_from_pytorch|install_builds|replicas of|torch_lines|clang_format|header_self')
}

gpu_bench() {
  build-gpu/bench/actorpipe_gpu_bench --json "$out/gpu_bench.json"
}

run() {
  out=$(realpath -m "$1")
  mkdir -p "$out"
  : >"$out/gpu-check.log"
  export PATH="$root/cmake-wheel/bin:$PATH"
  export LD_LIBRARY_PATH="$root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export CUBLAS_WORKSPACE_CONFIG=:4096:8
  (nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true) \
    >"$out/gpu.txt" 2>&1
  python3 -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())' \
    >>"$out/gpu.txt" 2>&1
  stage unpack unpack
  stage build configure_and_build
  if [[ ${status[build]} == ok ]]; then
    stage gpu_tests gpu_tests
    stage cpu_tests cpu_tests
    stage gpu_bench gpu_bench
  fi
  python3 - "$out" "$(declare -p status)" "$(declare -p seconds)" <<'PY'
import json, os, re, sys
out = sys.argv[1]
def parse(decl):
    return dict(re.findall(r'\[([^\]]+)\]="([^"]*)"', decl))
status, seconds = parse(sys.argv[2]), parse(sys.argv[3])
result = {"gpu": open(os.path.join(out, "gpu.txt")).read().strip(),
          "stages": {k: {"status": v, "seconds": int(seconds.get(k, 0))} for k, v in status.items()}}
bench = os.path.join(out, "gpu_bench.json")
if os.path.exists(bench):
    result["bench"] = json.load(open(bench))
for name in ("gpu_tests", "cpu_tests"):
    log = os.path.join(out, name + ".log")
    if os.path.exists(log):
        lines = [l for l in open(log) if "tests passed" in l or "tests failed" in l]
        result["stages"][name]["summary"] = lines[-1].strip() if lines else ""
json.dump(result, open(os.path.join(out, "results.json"), "w"), indent=2)
print(json.dumps(result, indent=2))
PY
  for s in "${status[@]}"; do [[ $s == ok ]] || exit 1; done
}

case "${1:-}" in
  gather) gather ;;
  run) [[ $# -ge 2 ]] || { echo "usage: tools/gpu-check.sh run OUT_DIR" >&2; exit 2; }; run "$2" ;;
  *) echo "usage: tools/gpu-check.sh gather | run OUT_DIR" >&2; exit 2 ;;
esac
