#!/usr/bin/env bash
# actorpipe set-up: installs what is missing (Debian 12, as root), builds, then
#   ./setup.sh run [train flags...]   runs the main job (`actorpipe train` with defaults)
#   ./setup.sh test                   runs the whole test suite through CTest
#   ./setup.sh build                  only builds
#   ./setup.sh deps                   only installs the system packages a build needs, for
#                                     `pip install .` into your own torch's environment
#                                     (docs/install.md)
#   ./setup.sh python                 builds the Python module and installs the torch it needs
#                                     (Debian's python3-torch): then PYTHONPATH=build/python python3
#   ./setup.sh sanitize [address|thread]
#                                     unit tests built with AddressSanitizer + UBSan (build-asan),
#                                     and the actor tests with ThreadSanitizer (build-tsan); both
#                                     unless one is named
# With `--torch pip` after build or test: the PyTorch 2.11 line instead of Debian's libtorch 1.13:
# a venv .venv-torch with the torch 2.11 wheel from PyPI (a CUDA 13.0 build; its libtorch, headers
# and CMake config are under torch/), into which `pip install .` builds actorpipe (CUDA and NCCL,
# docs/gpu.md) in the build folder build-cuda/.
#   ./setup.sh build --torch pip      builds and installs the CUDA line
#   ./setup.sh test --torch pip       the same with what CI checks of it, and runs its CPU tests
#                                     and the GPU tests (skipped without a GPU)
# With `--torch newest` after test: the same through `pip install .` into .venv-newest, with the
# newest torch on PyPI, the CPU engine (build-newest/), and the Python and export tests.
set -euo pipefail
cd "$(dirname "$0")"

# What every build needs; a build against a torch from pip needs only these.
packages=(
  build-essential cmake ccache clang-format
  libcaf-dev              # C++ Actor Framework 0.17
  libboost-dev            # Boost.Asio
  libcli11-dev nlohmann-json3-dev libspdlog-dev doctest-dev zlib1g-dev libssl-dev libbenchmark-dev
  libstb-dev              # stb_image: JPEG/PNG decoding for --data images:DIR
  pybind11-dev python3-dev  # the Python module `actorpipe` (python/, docs/python.md)
  dataset-fashion-mnist   # the real data of the main job
  fortunes                # the real text of --data text (/usr/share/games/fortunes)
)
# Debian's libtorch line, the default build.
debian_torch_packages=(
  libtorch-dev            # libtorch 1.13 (CPU), with c10d Gloo
  libgloo-dev             # headers of Gloo, which c10d's ProcessGroupGloo.hpp includes
  libopenblas0-openmp     # without it Debian's libtorch falls back to the reference BLAS
)
# Only the tests need these.
test_packages=(
  python3-torch           # PyTorch 1.13 itself: the tests' oracle (tests/oracle/*.py)
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

# A unity build (four sources to a translation unit, CMake's UNITY_BUILD): libtorch's templates
# are parsed and instantiated a quarter as often. Cold, on 2 cores: 14.5 min against ~25 for one
# source at a time. For edit-compile cycles, configure a build of your own without it (cmake -S .
# -B build-dev): there a change recompiles one source, not four.
# `run` builds the one program the main job needs; `build` and `test` build everything.
build() {
  cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DCMAKE_UNITY_BUILD=ON -DCMAKE_UNITY_BUILD_BATCH_SIZE=4
  cmake --build build -j"$(nproc)" "$@"
}

# Unit tests under sanitizers: a build of the library and the test binaries that need no
# external process (the CLI tests run the program, the install test a whole install).
sanitized_tests="models_test stages_test actors_test scheduler_test trace_test pipeline_test torchscript_test replicas_test training_test comm_test nodes_test memory_test"
sanitize() {
  local kind=$1 dir=$2 tests=$3
  # -O1: the sanitizers' usual level, and quicker to compile than Release's -O3 (CI runs three
  # builds; it must stay within its time). A unity build (four sources to a translation unit)
  # parses libtorch's templates a quarter as often: the cold ASan build of the library and the
  # twelve test binaries took ~15 min on 2 cores (about 25 before, not measured side by side).
  cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="-O1 -DNDEBUG" \
    -DACTORPIPE_SANITIZE="$kind" -DACTORPIPE_BUILD_BENCH=OFF \
    -DCMAKE_UNITY_BUILD=ON -DCMAKE_UNITY_BUILD_BATCH_SIZE=4 -DACTORPIPE_TEST_SET="${tests// /;}"
  cmake --build "$dir" -j"$(nproc)" --target actorpipe_test_set
  for t in $tests; do
    echo "== $t ($kind)"
    local start=$SECONDS
    # The PyTorch oracle checks numerics in a Python child process; the Release build runs it.
    # CUDA graphs' auto rule decides by the host's time per action (under 2 ms), which a
    # sanitizer's slowdown changes; the Release build runs that case, graph_book_test the rule.
    "$dir/tests/$t" --test-case-exclude="PyTorch is the oracle*,CUDA graphs: auto captures*"
    echo "== $t ($kind): $((SECONDS - start)) s"
  done
}

# The PyTorch 2.x lines: a venv holding a torch from PyPI, into which `pip install .` builds
# actorpipe (pyproject.toml) in a build folder of the line's own, kept between runs so that a second
# install rebuilds only what changed. The models the tests train come from transformers and
# torchvision (tests/oracle/hf_models.py); torchvision is pinned to the release built for the
# torch, or pip would replace the torch.
pinned_torch=('torch==2.11.*' 'torchvision==0.26.*')
newest_torch=(torch torchvision)  # pip picks the newest torch and the torchvision built for it
model_specs=('transformers>=5.25,<6' safetensors numpy)
pip_venv() {  # venv torch-specs...
  local venv=$1
  shift
  if [[ ! -x $venv/bin/python ]] && ! python3 -m venv "$venv"; then
    # Debian's python3 makes venvs only with python3-venv.
    rm -rf "$venv"
    packages=(python3-venv)
    install_missing
    python3 -m venv "$venv"
  fi
  if ! "$venv/bin/python" -c 'import torch, torchvision, transformers, safetensors' 2>/dev/null; then
    echo "setup: installing $* ${model_specs[*]} from PyPI into $venv (a CUDA wheel, ~3 GB with its CUDA libraries)"
    "$venv/bin/pip" install -q "$@" "${model_specs[@]}"
  fi
}
# pip install . into a venv, built in a folder of its own with the tests configured (ctest runs
# there; the Python tests import the installed package and run the installed program).
pip_install() {  # venv build-dir targets (";"-separated, empty: all) [pip args...]
  local venv=$1 dir=$2 targets=$3
  shift 3
  # A folder configured by hand before (plain cmake, perhaps another generator) starts afresh.
  if [[ -f $dir/CMakeCache.txt ]] && ! grep -q '^ACTORPIPE_TORCH_FROM_PYTHON' "$dir/CMakeCache.txt"; then
    rm -rf "$dir/CMakeCache.txt" "$dir/CMakeFiles"
  fi
  local args=(-C build-dir="$dir" -C cmake.define.ACTORPIPE_BUILD_TESTS=ON)
  [[ -n $targets ]] && args+=(-C build.targets="$targets")
  "$venv/bin/pip" install -v . "${args[@]}" "$@"
}
# The targets CI builds on the pinned line: every library (libtorch_cuda, NCCL), the program, the
# GPU tests and the CPU tests that run against it.
cuda_targets="actorpipe_cli;actorpipe_python;gpu_test;pipeline_test"

command=${1:-run}
shift || true
torch_line=debian
if [[ ${1:-} == --torch ]]; then
  torch_line=${2:-}
  [[ $torch_line == pip || $torch_line == newest || $torch_line == debian ]] ||
    { echo "setup: --torch debian|pip|newest" >&2; exit 2; }
  shift 2
fi
if [[ $command == deps ]]; then
  install_missing
  echo "setup: the system packages are installed; now pip install . in the environment of your torch"
  exit 0
fi
[[ $torch_line == debian ]] && packages+=("${debian_torch_packages[@]}")
[[ $command == test || $command == python ]] && packages+=("${test_packages[@]}")
install_missing
if [[ $torch_line == newest ]]; then
  [[ $command == test ]] || { echo "setup: --torch newest goes with test" >&2; exit 2; }
  pip_venv .venv-newest "${newest_torch[@]}"
  pip_install .venv-newest build-newest "actorpipe_cli;actorpipe_python" \
    -C cmake.define.ACTORPIPE_WITH_CUDA=OFF
  # The Python and export tests (the engine on the CPU): the oracle, the API, exported programs,
  # transformers and torchvision models, and the PT2 example through the program.
  cd build-newest && exec ctest -j2 --output-on-failure --timeout 600 \
    -R '^python_|^example_from_pytorch_exported$' -E '^python_gpu' "$@"
fi
if [[ $torch_line == pip ]]; then
  case "$command" in
    build) pip_venv .venv-torch "${pinned_torch[@]}" && pip_install .venv-torch build-cuda "" ;;
    test)
      pip_venv .venv-torch "${pinned_torch[@]}"
      pip_install .venv-torch build-cuda "$cuda_targets"
      # The CPU tests of the 2.x line: the pipeline's numerics and errors against plain libtorch
      # 2.11 and the wheel's own torch as the oracle, the main job's losses against the 1.13
      # line's, and the GPU tests (skipped without a GPU). Not here: the binaries this line does
      # not build, replicas on the CPU, which need Gloo (not in the wheel; docs/gpu.md), and the
      # chaos soak (the same fault paths as the default line's, which runs it; here each process
      # it starts loads libtorch_cuda first), and the checks of the sources themselves that do
      # not depend on the line: each public header compiling alone, the layer order and typed
      # protocols refusing to build, the format (~5 min of compiling on 2 cores; the default
      # line runs them).
      cd build-cuda && exec ctest -j2 --output-on-failure --timeout 600 \
        -E '_NOT_BUILT|nodes_across|example_from_pytorch|install_builds|replicas of|chaos_soak|header_self_contained|architecture_includes|clang_format' \
        "$@" ;;
    *) echo "setup: --torch pip goes with build or test" >&2; exit 2 ;;
  esac
  exit 0
fi
if [[ $command == sanitize ]]; then
  kinds=${1:-address thread}
  [[ $kinds == address || $kinds == thread || $kinds == "address thread" ]] ||
    { echo "setup: sanitize takes address, thread or nothing (both), not '$kinds'" >&2; exit 2; }
  if [[ $kinds == *address* ]]; then
    # libtorch and CAF keep process-lifetime allocations: leaks are not checked.
    export ASAN_OPTIONS=detect_leaks=0:detect_odr_violation=0:abort_on_error=1
    export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
    sanitize address,undefined build-asan "$sanitized_tests"
  fi
  if [[ $kinds == *thread* ]]; then
    # ThreadSanitizer on the actor tests; libgomp and libtorch are not instrumented, see
    # docs/troubleshooting.md and .ci/tsan.supp.
    export TSAN_OPTIONS="suppressions=$PWD/.ci/tsan.supp halt_on_error=1 second_deadlock_stack=1"
    export OMP_NUM_THREADS=1
    sanitize thread build-tsan "actors_test pipeline_test replicas_test"
  fi
  exit 0
fi
if [[ $command == run ]]; then
  build --target actorpipe_cli
elif [[ $command == python ]]; then
  build --target actorpipe_python
  echo "setup: the module is in build/python: PYTHONPATH=$PWD/build/python python3 -c 'import actorpipe'"
  exit 0
else
  build
fi
case "$command" in
  run) exec build/cli/actorpipe train "$@" ;;
  test) cd build && exec ctest -j2 --output-on-failure --timeout 600 "$@" ;;
  build) ;;
  *) echo "usage: ./setup.sh run|test|build|deps|python|sanitize [args...]" >&2; exit 2 ;;
esac
