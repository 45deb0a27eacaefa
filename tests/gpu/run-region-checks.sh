#!/usr/bin/env bash
# Shared cache regions and job start on a GPU host, from a bundle made by
# deploy/make-bundle.sh --with-tests: the core's region tests, the row
# gather kernels and device-resident batches against the CPU, the regions
# end to end on the CUDA backend (and on the host backend), the job tests
# on the CUDA backend, then the start benchmark (submit -> first step:
# dataset resident, absent, private, cold agent). Needs the Fashion-MNIST
# IDX files in /usr/share/datasets/fashion-mnist. Logs go to $OUT (or
# ./gpu-logs).
#
#   bash tests/gpu/run-region-checks.sh BUNDLE_DIR
#
# LEASEHOLD_TESTS=0 skips the tests; LEASEHOLD_BENCH=none the benchmark;
# LEASEHOLD_START_ARGS: more arguments for it (e.g. --jobs 20).
set -uo pipefail
bundle=$(cd "${1:?usage: run-region-checks.sh BUNDLE_DIR}" && pwd)
out=${OUT:-$PWD/gpu-logs}
mkdir -p "$out"
bin=$bundle/bin
source "$(dirname "${BASH_SOURCE[0]}")/steps.sh"

nvidia-smi -L | tee "$out/summary.txt"
if [ "${LEASEHOLD_TESTS:-1}" != 0 ]; then
  step core_regions "$bin/core_test" --gtest_filter='Regions*'
  step engine_cuda_test "$bin/engine_cuda_test"
  step regions_cuda env LEASEHOLD_TEST_BACKEND=cuda "$bin/regions_integration_test"
  step regions_host "$bin/regions_integration_test"
  step job_integration_cuda env LEASEHOLD_TEST_BACKEND=cuda "$bin/job_integration_test"
  step integration_cuda_test "$bin/integration_cuda_test"
fi
# Two standby agents on the CUDA backend: `leasehold status` shows them
# warming, then idle, with their device memory outside the pool.
standby_status() {
  local run; run=$(mktemp -d)
  export LEASEHOLD_ENDPOINT="ipc://$run/c.sock"
  "$bin/leasehold-coordinator" --backend cuda --mps off --pool-size 4GiB --state-dir "$run/state" &
  local coord=$!
  for _ in $(seq 100); do "$bin/leasehold" --timeout 200ms status >/dev/null 2>&1 && break; sleep 0.1; done
  "$bin/leasehold-agent" --name standby-a > "$run/a.log" 2>&1 &
  local a=$!
  "$bin/leasehold-agent" --name standby-b > "$run/b.log" 2>&1 &
  local b=$!
  local rc=1
  for _ in $(seq 600); do
    [ "$("$bin/leasehold" status -o json | grep -c '"state": "idle"')" -ge 2 ] && rc=0 && break
    sleep 0.1
  done
  "$bin/leasehold" status
  "$bin/leasehold" status -o json | grep -E '"(name|state|outside_pool_bytes)"'
  grep -h "warmed up" "$run/a.log" "$run/b.log"
  kill -TERM $a $b; wait $a $b
  kill -TERM $coord; wait $coord
  rm -rf "$run"
  unset LEASEHOLD_ENDPOINT
  return $rc
}
step standby_status standby_status
if [ "${LEASEHOLD_BENCH:-all}" != none ]; then
  step bench_start "$bin/leasehold-bench-start" --backend cuda --job "$bundle/jobs/fashion-mnist-mlp.json" ${LEASEHOLD_START_ARGS:-}
  sed -n '/^mode/,$p' "$out/bench_start.log" | tee -a "$out/summary.txt"
fi
finish
