#!/usr/bin/env bash
# Configures and builds Leasehold into ./build (or $LEASEHOLD_BUILD_DIR).
# Extra arguments go to cmake's configure step, e.g. -DLEASEHOLD_CUDA=OFF.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${LEASEHOLD_BUILD_DIR:-$root/build}
jobs=${LEASEHOLD_JOBS:-$(nproc)}
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=${CMAKE_BUILD_TYPE:-RelWithDebInfo} "$@"
cmake --build "$build" -j "$jobs"
