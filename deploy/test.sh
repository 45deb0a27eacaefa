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
#
# The benchmark programs and the sanitizer build are compiled in the
# background, at a lower priority, while the first pass's tests and the
# fuzzers run: most of those tests wait on processes, sockets and timers,
# and the compilers take the cores they leave (the tests allow for busy
# cores). Their log is $build/background-build.log.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
jobs=${LEASEHOLD_JOBS:-$(nproc)}
"$root/deploy/setup.sh" --with-test-tools
LEASEHOLD_BUILD_TARGETS=all "$root/deploy/build.sh" "$@"
build=${LEASEHOLD_BUILD_DIR:-$root/build}
asan=${LEASEHOLD_ASAN_BUILD_DIR:-$root/build-asan}
sanitize=1
[ "${LEASEHOLD_SKIP_SANITIZERS:-0}" = 1 ] && sanitize=0

background_log=$build/background-build.log
set -m  # the background builds get a process group of their own (killed whole below)
(
  echo "== benchmark programs ($build)"
  nice -n 10 cmake --build "$build" -j "$jobs" --target leasehold-benchmarks
  if [ $sanitize = 1 ]; then
    echo "== sanitizer build ($asan)"
    # Built at -O1 -g1 (CMakeLists.txt), without the benchmark programs, which
    # no test runs, and without the tests that cover timing, monitoring tools,
    # the GPU and exit statuses rather than memory or hostile input
    # (NO_SANITIZER).
    LEASEHOLD_BUILD_DIR="$asan" LEASEHOLD_BUILD_TARGETS=all nice -n 10 "$root/deploy/build.sh" \
      -DLEASEHOLD_SANITIZE=ON -DLEASEHOLD_CUDA=OFF -DLEASEHOLD_BENCHMARKS=OFF
  fi
) > "$background_log" 2>&1 &
background=$!
set +m
# Whatever ends this script (a failed test included) ends the builds too.
trap 'kill -- -$background 2>/dev/null || true' EXIT

echo "== test suite ($build)"
(cd "$build" && ctest --output-on-failure -j "$jobs" --timeout 300)
echo "== fuzzing the envelope decoder and the job-file parser (${LEASEHOLD_FUZZ_SECONDS:-60} s each)"
"$root/tests/fuzz/run-fuzzers.sh" "$build" "${LEASEHOLD_FUZZ_SECONDS:-60}"

echo "== waiting for the background builds (log: $background_log)"
if ! wait $background; then
  tail -60 "$background_log"
  echo "test.sh: the background build failed (log: $background_log)" >&2
  exit 1
fi
trap - EXIT
tail -3 "$background_log"

if [ $sanitize = 0 ]; then
  echo "== sanitizer pass skipped (LEASEHOLD_SKIP_SANITIZERS=1)"
  exit 0
fi
echo "== test suite under ASan and UBSan ($asan)"
# Any report stops the process that made it, so the test that started it fails.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
(cd "$asan" && ctest --output-on-failure -j "$jobs" --timeout 600)
