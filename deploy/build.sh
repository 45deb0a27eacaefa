#!/usr/bin/env bash
# Configures and builds Leasehold into ./build (or $LEASEHOLD_BUILD_DIR): the
# daemons, the client, the tests and then the benchmark programs.
# Extra arguments go to cmake's configure step, e.g. -DLEASEHOLD_CUDA=OFF.
# LEASEHOLD_BUILD_TARGETS names what to build instead (default:
# "all leasehold-benchmarks"; deploy/test.sh builds `all` first and the
# benchmarks beside its first test pass).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${LEASEHOLD_BUILD_DIR:-$root/build}
jobs=${LEASEHOLD_JOBS:-$(nproc)}
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=${CMAKE_BUILD_TYPE:-RelWithDebInfo} "$@"
# shellcheck disable=SC2086  # a list of targets
cmake --build "$build" -j "$jobs" --target ${LEASEHOLD_BUILD_TARGETS:-all leasehold-benchmarks}
