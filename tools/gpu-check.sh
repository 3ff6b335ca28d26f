#!/usr/bin/env bash
# The GPU check on a machine with a GPU and PyTorch but no network and none of Debian's packages
# (docs/gpu.md):
#
#   tools/gpu-check.sh gather        on a connected Debian 12 machine: downloads the Debian packages
#                                    the build needs (apt-get download) and a cmake wheel into
#                                    .gpu-debs/ (ignored by git; about 48 MB, iproute2's 3 MB in
#                                    .gpu-debs/net)
#   tools/gpu-check.sh run OUT       on the GPU machine, from the tree's root with .gpu-debs/ beside
#                                    it: unpacks the packages into .gpu-root/, builds against that
#                                    machine's own torch with every core (build-gpu/), runs the GPU
#                                    tests, the GPU bench, the memory model and the slow-link
#                                    schedules on its cores, and writes logs and results.json to OUT
#
# `run` needs python3 with a CUDA build of torch, g++, and cmake (or the gathered wheel). It
# reports every stage in OUT/results.json, also the ones that failed, and exits non-zero when one
# did. Every stage has a deadline, and the whole check ends within GPU_CHECK_SECONDS (500 by
# default), so that it returns its logs inside a 10-minute call on 16 cores. GPU_CHECK_SKIP names
# stages to leave out (e.g. "gpu_bench cpu_tests" for a second call on the same day);
# GPU_CHECK_TARGETS the targets to build (e.g. "actorpipe_cli" for the slow link alone).
set -uo pipefail
script=$(realpath "$0")
cd "$(dirname "$script")/.."

debs_dir=.gpu-debs
root=$PWD/.gpu-root
packages=(
  libcaf-dev libcaf-core0.17 libcaf-io0.17 libcaf-openssl0.17 # C++ Actor Framework 0.17
  libboost1.74-dev                                            # Boost.Asio
  libcli11-dev nlohmann-json3-dev doctest-dev libstb-dev libstb0
  libspdlog-dev libspdlog1.10 libfmt-dev libfmt9
  zlib1g-dev libssl-dev libssl3 # libssl3: what libssl-dev's links point to
)
# iproute2 and what it links, for bench/slow_link.sh where the machine has no ip or tc: unpacked
# apart (.gpu-root/net), its libraries behind the machine's own, for ip and tc alone.
net_packages=(
  iproute2 libbpf1 libbsd0 libcap2 libdb5.3 libelf1 libmnl0 libselinux1 libtirpc3 libtirpc-common
  libxtables12 libmd0 libpcre2-8-0 libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0
  libcom-err2 libkeyutils1
)

gather() {
  set -e
  mkdir -p "$debs_dir"
  (cd "$debs_dir" && apt-get download "${packages[@]}")
  mkdir -p "$debs_dir/net"
  (cd "$debs_dir/net" && apt-get download "${net_packages[@]}")
  # cmake for a machine without it: a manylinux wheel (pure binary, any Python 3).
  python3 -m pip download --no-deps --only-binary=:all: --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --python-version 3.12 -d "$debs_dir" 'cmake<4' >/dev/null
  du -sh "$debs_dir"
}

log() { echo "gpu-check: $*" | tee -a "$out/gpu-check.log"; }

# Runs a named stage under a deadline (its own cap, and what is left of the whole check's),
# its output to OUT/logs/NAME.log; records its status and seconds.
declare -A status seconds
stage() {
  local name=$1 cap=$2
  shift 2
  local start=$SECONDS left=$((deadline - SECONDS))
  ((left < cap)) && cap=$left
  if [[ " ${GPU_CHECK_SKIP:-} " == *" $name "* ]]; then
    status[$name]="skipped (GPU_CHECK_SKIP)"
    seconds[$name]=0
    log "$name: ${status[$name]}"
    return
  fi
  if ((cap < 10)); then
    status[$name]="not run (the check's deadline)"
    seconds[$name]=0
    log "$name: ${status[$name]}"
    return
  fi
  log "$name (at most $cap s): $*"
  timeout -k 10 "$cap" "$script" _stage "$@" >"$out/logs/$name.log" 2>&1
  local rc=$?
  case $rc in
    0) status[$name]=ok ;;
    124 | 137) status[$name]="timed out after $cap s" ;;
    *) status[$name]="failed ($rc)" ;;
  esac
  seconds[$name]=$((SECONDS - start))
  log "$name: ${status[$name]} after ${seconds[$name]} s"
}

# extract DEB DIR: a package's files into DIR, with dpkg-deb or, without it, ar and tar.
extract() {
  if command -v dpkg-deb >/dev/null; then
    dpkg-deb -x "$1" "$2"
  else
    local data
    data=$(ar t "$1" | grep '^data.tar')
    ar p "$1" "$data" | tar -x -C "$2" --auto-compress -f - 2>/dev/null ||
      ar p "$1" "$data" | tar -xJ -C "$2"
  fi
}

unpack() {
  rm -rf "$root" && mkdir -p "$root"
  for deb in "$debs_dir"/*.deb; do
    extract "$deb" "$root"
  done
  # ip and tc where the machine has none: wrappers that find the gathered libraries after the
  # machine's (what `ip netns exec` starts inherits that path too, the machine's libraries first).
  if ! command -v tc >/dev/null && compgen -G "$debs_dir/net/*.deb" >/dev/null; then
    mkdir -p "$root/net/wrappers"
    for deb in "$debs_dir"/net/*.deb; do
      extract "$deb" "$root/net"
    done
    local libs="$root/net/lib/x86_64-linux-gnu:$root/net/usr/lib/x86_64-linux-gnu" tool
    for tool in bin/ip sbin/tc; do
      printf '#!/bin/sh\nLD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}%s" exec %s "$@"\n' \
        "$libs" "$root/net/$tool" >"$root/net/wrappers/${tool#*/}"
      chmod +x "$root/net/wrappers/${tool#*/}"
    done
  fi
  if ! command -v cmake >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --target "$root/cmake-wheel" \
      "$debs_dir"/cmake-*.whl
  fi
}

# The Python module needs Python's headers (pybind11 comes with torch's); without them it is not
# built, and its tests are not registered.
python_module() {
  python3 -c 'import os, sysconfig
raise SystemExit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' &&
    echo ON || echo OFF
}

configure_and_build() {
  local torch_dir lib=$root/usr/lib/x86_64-linux-gnu generator=() python targets=()
  python=$(python_module)
  # zlib: the machine's shared one (the gathered zlib1g-dev's libz.so points to a runtime not
  # gathered, and its libz.a is not position-independent, which the Python module needs).
  local zlib
  zlib=$(ls /lib/x86_64-linux-gnu/libz.so.1 /usr/lib/x86_64-linux-gnu/libz.so.1 /usr/lib64/libz.so.1 \
    2>/dev/null | head -1)
  [[ $python == ON ]] && targets=(actorpipe_python)
  echo "the Python module: $python"
  torch_dir=$(python3 -c 'import os, torch; print(os.path.dirname(torch.__file__))')
  # Ninja where there is one, unless build-gpu/ was configured before (its generator stays).
  [[ ! -f build-gpu/CMakeCache.txt ]] && command -v ninja >/dev/null && generator=(-G Ninja)
  cmake -S . -B build-gpu "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DCMAKE_UNITY_BUILD=ON \
    -DCMAKE_UNITY_BUILD_BATCH_SIZE=4 -DACTORPIPE_WITH_CUDA=ON -DACTORPIPE_WITH_NCCL=ON \
    -DCMAKE_PREFIX_PATH="$torch_dir/share/cmake;$root/usr;$lib/cmake;$root/usr/share/cmake" \
    -DCMAKE_LIBRARY_PATH="$torch_dir/lib;$lib" -DCMAKE_INCLUDE_PATH="$root/usr/include" \
    -DCMAKE_CXX_FLAGS="-isystem $root/usr/include" \
    -DCMAKE_EXE_LINKER_FLAGS="-L$lib -Wl,-rpath,$lib" -DACTORPIPE_PYTHON="$(command -v python3)" \
    -DCMAKE_MODULE_LINKER_FLAGS="-L$lib -Wl,-rpath,$lib" -DACTORPIPE_BUILD_PYTHON="$python" \
    ${zlib:+-DZLIB_LIBRARY="$zlib" -DZLIB_LIBRARY_RELEASE="$zlib"} &&
    cmake --build build-gpu -j"$(nproc)" --target ${GPU_CHECK_TARGETS:-actorpipe_cli gpu_test \
      pipeline_test actorpipe_gpu_bench "${targets[@]}"}
}

gpu_tests() {
  (cd build-gpu && ctest -L gpu --output-on-failure --timeout 120)
}

# The main program on the GPU as a user runs it: two stages sharing cuda:0, a trace of the steps.
# Then the gpt of the bench in bf16, traced: where a GPU's time goes.
cli_run() {
  build-gpu/cli/actorpipe train --data synthetic --devices cuda:0,cuda:0 --steps 8 \
    --microbatches 4 --trace "$out/trace.json" --json "$out/cli.json" &&
    build-gpu/cli/actorpipe train --data synthetic --model gpt --width 1024 --layers 8 --heads 8 \
      --context 512 --batch 16 --precision bf16 --devices cuda:0,cuda:0 --steps 6 \
      --microbatches 4 --trace "$out/trace_gpt.json"
}

cpu_tests() {
  local skip='_NOT_BUILT|nodes_across|example_from_pytorch|install_builds|replicas of|torch_lines'
  skip+='|clang_format|header_self'
  (cd build-gpu && ctest -j8 --output-on-failure --timeout 120 -LE gpu -E "$skip")
}

# For the first test that crashed: how its program links, which library each std::filesystem
# symbol bound to, and a backtrace under gdb (cuda-gdb where there is no gdb).
backtrace() {
  local name
  name=$(grep -ho 'Test *#[0-9]*: .* \.\.\.*\*\*\*Exception: SegFault' "$out"/logs/*tests.log |
    head -1 | sed -E 's/^Test *#[0-9]*: (.*[^ ]) \.+\*\*\*Exception.*/\1/')
  [[ -n $name ]] || { echo "no test crashed"; return 0; }
  local command
  command=$(cd build-gpu && ctest --show-only=json-v1 | python3 -c '
import json, shlex, sys
for t in json.load(sys.stdin)["tests"]:
    if t["name"] == sys.argv[1]:
        print(shlex.join(t["command"]))' "$name")
  echo "crashed: $name"
  echo "command: $command"
  local program=${command%% *}
  readelf -d "$program" | grep NEEDED
  (cd build-gpu && LD_DEBUG=bindings eval "$command" 2>&1 | grep -E 'filesystem|directory_iterator' |
    sed -E 's/^ *[0-9]+: *//' | sort | uniq -c | sort -rn | head -40)
  local libstdcxx
  libstdcxx=$(c++ -print-file-name=libstdc++.so.6)
  echo "libstdc++: $(realpath "$libstdcxx")"
  (cd build-gpu && LD_PRELOAD=$libstdcxx eval "$command" >/dev/null 2>&1)
  echo "with LD_PRELOAD=$libstdcxx: exit $?"
  local gdb
  gdb=$(command -v gdb || command -v cuda-gdb) || { echo "no gdb"; return 0; }
  (cd build-gpu && eval "timeout 120 $gdb -batch -ex run -ex bt -ex 'info sharedlibrary' --args $command" 2>&1 | tail -120)
}

gpu_bench() {
  build-gpu/bench/actorpipe_gpu_bench --json "$out/gpu_bench.json"
}

# Schedules over two nodes on a slow link, on this machine's cores (the stages on the CPU, one
# thread each, so that no transfer takes a core from a stage): the rate set so that a transfer
# takes a third of a stage's compute per micro-batch (issue 42's DualPipeV goal). Needs root,
# network namespaces and tc in the kernel.
slow_link() {
  [[ -d $root/net/wrappers ]] && export PATH="$root/net/wrappers:$PATH"
  ip netns add gpucheck-probe && ip netns del gpucheck-probe || { echo "no network namespaces"; return 1; }
  local m
  for m in ${SLOW_LINK_MICROBATCHES:-8 16}; do
    ACTORPIPE=build-gpu/cli/actorpipe RUNS=${SLOW_LINK_RUNS:-2} MICROBATCHES=$m \
      bench/slow_link.sh share:0.33 "${SLOW_LINK_SCHEDULES:-1f1b,zb-h1,dualpipe-v}" 20 || return 1
  done
}

# The memory model on the GPU: plan profiles on cuda:0, each stage trains alone there
# (bench/memory_model.py --gpu); the table into the log, the rows into memory.json.
memory_model() {
  python3 bench/memory_model.py build-gpu/cli/actorpipe --gpu --resnet50 --json "$out/memory.json"
}

# OUT holds at most 9 files once done: gpu-check.log, results.json, gpu_bench.json, memory.json,
# cli.json, trace.json, trace_gpt.json and logs.tar.gz (every stage's log; the failed ones' last lines are
# in results.json).
run() {
  out=$(realpath -m "$1")
  deadline=$((SECONDS + ${GPU_CHECK_SECONDS:-500}))
  mkdir -p "$out/logs"
  : >"$out/gpu-check.log"
  export out root
  export PATH="$root/cmake-wheel/bin:$PATH"
  command -v nvcc >/dev/null || export PATH="/usr/local/cuda/bin:$PATH"
  export LD_LIBRARY_PATH="$root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export CUBLAS_WORKSPACE_CONFIG=:4096:8
  {
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())'
    echo "nvcc: $(command -v nvcc) $(nvcc --version 2>/dev/null | tail -1)"
    echo "c++: $(c++ --version 2>/dev/null | head -1); cmake: $(cmake --version 2>/dev/null | head -1); cores: $(nproc)"
  } >"$out/logs/gpu.txt" 2>&1
  cat "$out/logs/gpu.txt" >>"$out/gpu-check.log"
  stage unpack 60 unpack
  stage build 330 configure_and_build
  if [[ ${status[build]} == ok ]]; then
    stage gpu_tests 200 gpu_tests
    stage gpu_bench 240 gpu_bench # graphs off and on side by side (docs/gpu.md#cuda-graphs)
    stage cli 60 cli_run
    stage memory 200 memory_model
    stage slow_link 180 slow_link
    [[ ${GPU_CHECK_CPU_TESTS:-1} == 1 ]] && stage cpu_tests 120 cpu_tests
    grep -q 'Exception: SegFault' "$out"/logs/*tests.log && stage backtrace 150 backtrace
  fi
  python3 - "$out" "$(declare -p status)" "$(declare -p seconds)" <<'PY'
import json, os, re, sys
out = sys.argv[1]
logs = os.path.join(out, "logs")
def parse(decl):
    return dict(re.findall(r'\[([^\]]+)\]="([^"]*)"', decl))
status, seconds = parse(sys.argv[2]), parse(sys.argv[3])
result = {"gpu": open(os.path.join(logs, "gpu.txt")).read().strip(),
          "stages": {k: {"status": v, "seconds": int(seconds.get(k, 0))} for k, v in status.items()}}
bench = os.path.join(out, "gpu_bench.json")
if os.path.exists(bench):
    result["bench"] = json.load(open(bench))
for name, s in result["stages"].items():
    log = os.path.join(logs, name + ".log")
    if not os.path.exists(log):
        continue
    lines = open(log, errors="replace").read().splitlines()
    summary = [l for l in lines if "tests passed" in l or "tests failed" in l]
    if summary:
        s["summary"] = summary[-1].strip()
    if s["status"] != "ok" or name in ("gpu_tests", "gpu_bench", "cli", "memory", "slow_link",
                                       "backtrace"):
        s["tail"] = lines[-60:]
json.dump(result, open(os.path.join(out, "results.json"), "w"), indent=2)
print(json.dumps({k: v for k, v in result.items() if k != "bench"}, indent=1)[:6000])
PY
  tar -czf "$out/logs.tar.gz" -C "$out" logs && rm -rf "$out/logs"
  for s in "${status[@]}"; do [[ $s == ok || $s == skipped* ]] || exit 1; done
}

case "${1:-}" in
  gather) gather ;;
  _stage) shift; "$@" ;; # one stage of `run`, under its deadline

  run) [[ $# -ge 2 ]] || { echo "usage: tools/gpu-check.sh run OUT_DIR" >&2; exit 2; }; run "$2" ;;
  *) echo "usage: tools/gpu-check.sh gather | run OUT_DIR" >&2; exit 2 ;;
esac
