#!/usr/bin/env bash
# Memory isolation on the GPU host: the pool as chunks of cuMemCreate
# memory, each process mapping only its own leases' chunks. Tests: the CUDA
# integration tests (a kernel writing outside its agent's leases faults in
# that agent's context alone, without MPS), the same stray write under MPS
# (the fault machinery handles it; no pattern anywhere changes), and the
# suites whose memory now comes chunk by chunk (lease client, engine, lease
# allocator, jobs, devices, durability, paused agents, regions, spilling) on
# the CUDA backend.
# Benchmarks, side by side with OLD_BUNDLE (built before the chunked pool:
# one cudaMalloc shared whole through CUDA IPC) when given: the lease grant
# round trip at 2 MiB, 64 MiB and 1 GiB, and the coordinator's start with
# 80% of the GPU. Logs go to $OUT.
#
#   bash tests/gpu/run-isolation-checks.sh BUNDLE_DIR [OLD_BUNDLE_DIR]
#
# LEASEHOLD_ISO_TESTS=none skips the tests, LEASEHOLD_BENCH=none the benchmarks
# (start: only the start figures).
set -uo pipefail
bundle=$(cd "${1:?usage: run-isolation-checks.sh BUNDLE_DIR [OLD_BUNDLE_DIR]}" && pwd)
old=${2:+$(cd "$2" && pwd)}
out=${OUT:-$PWD/gpu-logs}
mkdir -p "$out"
bin=$bundle/bin
source "$(dirname "${BASH_SOURCE[0]}")/steps.sh"
ctl=$(command -v nvidia-cuda-mps-control || echo /usr/local/nvidia/bin/nvidia-cuda-mps-control)

# The stray write under MPS: two exercising agents and a third whose kernel
# writes at the first one's lease. Passes when the writer fails, nothing
# reports CORRUPTION, and the coordinator (outside MPS) serves on.
stray_under_mps() {
  [ -x "$ctl" ] || { echo "no nvidia-cuda-mps-control: skipped"; return 0; }
  local run; run=$(mktemp -d /tmp/lh-iso.XXXXXX)
  export LEASEHOLD_ENDPOINT="ipc://$run/c.sock"
  unset CUDA_MPS_PIPE_DIRECTORY
  "$bin/leasehold-coordinator" --backend cuda --mps on --pool-size 2GiB --state-dir "$run/state" \
    > "$run/coordinator.log" 2>&1 &
  local coord=$!
  for _ in $(seq 100); do "$bin/leasehold" --timeout 200ms status >/dev/null 2>&1 && break; sleep 0.1; done
  "$bin/leasehold-agent" --name v0 --exercise --leases 2 --lease-size 64MiB --rounds 20 --interval 100ms > "$run/v0.log" 2>&1 &
  local v0=$!
  "$bin/leasehold-agent" --name v1 --exercise --leases 2 --lease-size 64MiB --rounds 20 --interval 100ms > "$run/v1.log" 2>&1 &
  local v1=$!
  local target=""
  for _ in $(seq 100); do
    target=$("$bin/leasehold" status -o json | python3 -c 'import json,sys; l=json.load(sys.stdin)["leases"]; print(l[0]["offset"] if len(l) >= 4 else "")')
    [ -n "$target" ] && break; sleep 0.1
  done
  "$bin/leasehold-agent" --name rogue --exercise --leases 1 --lease-size 64MiB --rounds 1 \
    --test-stray-write "$target" > "$run/rogue.log" 2>&1
  local rogue_rc=$?
  wait $v0; local v0_rc=$?
  wait $v1; local v1_rc=$?
  "$bin/leasehold" status > "$run/status-after.txt" 2>&1; local status_rc=$?
  kill -TERM $coord; wait $coord
  cp "$run"/*.log "$run/status-after.txt" "$out/" 2>/dev/null
  rm -rf "$run"
  echo "rogue rc=$rogue_rc v0 rc=$v0_rc v1 rc=$v1_rc coordinator status rc=$status_rc"
  grep -h "CORRUPTION" "$out"/v0.log "$out"/v1.log && return 1
  grep -q "the stray write went through" "$out/rogue.log" && return 1
  [ $rogue_rc -ne 0 ] && [ $status_rc -eq 0 ]
}

# The coordinator's start with a pool of PERCENT of the GPU in chunks of
# ALIGNMENT: until `leasehold status` answers, then until it has exited
# after SIGTERM. Prints ms.
start_time() {
  local b=$1 percent=$2 alignment=$3 run; run=$(mktemp -d /tmp/lh-start.XXXXXX)
  local t0; t0=$(date +%s%N)
  LEASEHOLD_ENDPOINT="ipc://$run/c.sock" "$b/bin/leasehold-coordinator" --backend cuda --mps off \
    --pool-size "$percent" --alignment "$alignment" --state-dir "$run/state" > "$run/coordinator.log" 2>&1 &
  local coord=$!
  for _ in $(seq 1200); do
    LEASEHOLD_ENDPOINT="ipc://$run/c.sock" "$b/bin/leasehold" --timeout 200ms status >/dev/null 2>&1 && break
    kill -0 $coord 2>/dev/null || break
    sleep 0.05
  done
  local t1; t1=$(date +%s%N)
  kill -TERM $coord; wait $coord
  local t2; t2=$(date +%s%N)
  grep -h "pool of" "$run/coordinator.log" | head -1
  echo "start_ms=$(( (t1 - t0) / 1000000 )) stop_ms=$(( (t2 - t1) / 1000000 ))"
  rm -rf "$run"
}

nvidia-smi -L | tee "$out/summary.txt"
if [ "${LEASEHOLD_ISO_TESTS:-all}" != none ]; then
  step integration_cuda_test "$bin/integration_cuda_test"
  step stray_write_under_mps stray_under_mps
  step lease_client_test "$bin/lease_client_test"
  step engine_cuda_test "$bin/engine_cuda_test"
  step lease_allocator_test "$bin/lease_allocator_test"
  step job_integration_cuda env LEASEHOLD_TEST_BACKEND=cuda "$bin/job_integration_test"
  step devices_cuda env LEASEHOLD_TEST_BACKEND=cuda "$bin/devices_integration_test"
  step durability_cuda env LEASEHOLD_TEST_BACKEND=cuda "$bin/durability_test"
  step paused_agent_cuda env LEASEHOLD_TEST_BACKEND=cuda "$bin/paused_agent_test"
  step regions_cuda env LEASEHOLD_TEST_BACKEND=cuda "$bin/regions_integration_test"
  step spill_training_cuda env LEASEHOLD_TEST_BACKEND=cuda "$bin/spill_training_test"
fi
bench=${LEASEHOLD_BENCH:-all}
if [ "$bench" != none ]; then
  for size in 2MiB 64MiB 1GiB; do
    [ "$bench" = start ] && break
    iters=1000; [ $size = 1GiB ] && iters=200
    step "grant_$size" "$bin/leasehold-bench-lease" --backend cuda --agents 1 --sizes $size --iterations $iters
    if [ -n "$old" ]; then
      step "grant_${size}_ipc" "$old/bin/leasehold-bench-lease" --backend cuda --agents 1 --sizes $size --iterations $iters
    fi
  done
  # 80% of the GPU in 2 MiB chunks needs about 32,000 descriptors; hosts
  # whose hard limit is lower (and that do not let us raise it) get 4 MiB.
  step start_chunked_80_2MiB start_time "$bundle" 80% 2MiB
  step start_chunked_80_4MiB start_time "$bundle" 80% 4MiB
  step start_chunked_40_2MiB start_time "$bundle" 40% 2MiB
  if [ -n "$old" ]; then
    step start_ipc_80_2MiB start_time "$old" 80% 2MiB
    step start_ipc_40_2MiB start_time "$old" 40% 2MiB
  fi
  for f in "$out"/grant_*.log "$out"/start_*.log; do
    echo "== $(basename "$f")" | tee -a "$out/summary.txt"
    grep -E '"(grant|cycle)_p(50|99)_us"|"sizes"|start_ms|pool of' "$f" | tee -a "$out/summary.txt"
  done
fi
finish
