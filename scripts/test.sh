#!/usr/bin/env bash
# Builds Anvil with warnings as errors and runs every test through ctest.
#   scripts/test.sh              release build in build/
#   scripts/test.sh --sanitize   address + undefined-behaviour sanitizers in build-asan/
set -euo pipefail
cd "$(dirname "$0")/.."

build=build
flags=(-DANVIL_WERROR=ON)
if [ "${1:-}" = "--sanitize" ]; then
  build=build-asan
  flags+=(-DANVIL_SANITIZE=ON -DANVIL_BENCH=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo)
  # oneDNN's JIT and OpenMP's runtime keep allocations for the process's lifetime.
  export ASAN_OPTIONS=detect_leaks=0
  export UBSAN_OPTIONS=print_stacktrace=1
fi

cmake -S . -B "$build" -G Ninja "${flags[@]}" >/dev/null
ninja -C "$build"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}"
ctest --test-dir "$build" --output-on-failure -j1
