#!/usr/bin/env bash
# The test command: set up, build, and run the whole test suite through
# ctest; fuzz the decoder and the job-file parser for a minute each
# (tests/fuzz/run-fuzzers.sh, LEASEHOLD_FUZZ_SECONDS); then build the host
# backend again with ASan and UBSan (-O1 -g1, no benchmarks, and no tests
# marked NO_SANITIZER in tests/CMakeLists.txt; into build-asan, or
# $LEASEHOLD_ASAN_BUILD_DIR) and run the suite there too,
# the daemons and agents it starts included. LEASEHOLD_SKIP_SANITIZERS=1
# skips that second pass. GPU tests are skipped with a message where no GPU
# is visible. Extra arguments go to the first build's cmake configure step.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
jobs=${LEASEHOLD_JOBS:-$(nproc)}
"$root/deploy/setup.sh" --with-test-tools
"$root/deploy/build.sh" "$@"
build=${LEASEHOLD_BUILD_DIR:-$root/build}
echo "== test suite ($build)"
(cd "$build" && ctest --output-on-failure -j "$jobs" --timeout 300)
echo "== fuzzing the envelope decoder and the job-file parser (${LEASEHOLD_FUZZ_SECONDS:-60} s each)"
"$root/tests/fuzz/run-fuzzers.sh" "$build" "${LEASEHOLD_FUZZ_SECONDS:-60}"

if [ "${LEASEHOLD_SKIP_SANITIZERS:-0}" = 1 ]; then
  echo "== sanitizer pass skipped (LEASEHOLD_SKIP_SANITIZERS=1)"
  exit 0
fi
asan=${LEASEHOLD_ASAN_BUILD_DIR:-$root/build-asan}
echo "== test suite under ASan and UBSan ($asan)"
# Built at -O1 -g1 (CMakeLists.txt), without the benchmark programs, which no
# test runs, and without the tests that cover timing, monitoring tools, the
# GPU and exit statuses rather than memory or hostile input (NO_SANITIZER).
LEASEHOLD_BUILD_DIR="$asan" "$root/deploy/build.sh" -DLEASEHOLD_SANITIZE=ON -DLEASEHOLD_CUDA=OFF \
  -DLEASEHOLD_BENCHMARKS=OFF
# Any report stops the process that made it, so the test that started it fails.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
(cd "$asan" && ctest --output-on-failure -j "$jobs" --timeout 600)
