#!/usr/bin/env bash
# The test command: set up, build, and run the whole test suite through ctest.
# GPU tests are skipped with a message where no GPU is visible.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/deploy/setup.sh"
"$root/deploy/build.sh" "$@"
build=${LEASEHOLD_BUILD_DIR:-$root/build}
cd "$build"
ctest --output-on-failure -j "${LEASEHOLD_JOBS:-$(nproc)}" --timeout 300
