#!/usr/bin/env bash
# Runs Leasehold's GPU checks on a GPU host from a bundle made by
# deploy/make-bundle.sh --with-tests: unit tests (CUDA kernels against CPU),
# the CUDA integration tests (agent processes sharing one cudaMalloc pool
# through CUDA IPC), the host integration tests, the engine's tests (every
# CUDA operator against the CPU, training inside CUDA leases, the fence
# before leases go back), the coordinator core and job store tests, the job
# and durability tests on the host and on the CUDA backend, paused agents on
# the CUDA backend, a CUDA demo run, PyTorch programs as program jobs
# (run-torch-checks.sh, where python3 has a CUDA torch),
# and the lease and engine benchmarks with the PyTorch reference. Logs go to $OUT (or ./gpu-logs).
#
#   bash tests/gpu/run-gpu-checks.sh BUNDLE_DIR
#
# LEASEHOLD_BENCH=all (default), lease (only the lease benchmarks) or none:
# which benchmarks run after the tests.
set -uo pipefail
bundle=$(cd "${1:?usage: run-gpu-checks.sh BUNDLE_DIR}" && pwd)
out=${OUT:-$PWD/gpu-logs}
mkdir -p "$out"
bin=$bundle/bin
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$(dirname "${BASH_SOURCE[0]}")/steps.sh"

nvidia-smi -L | tee "$out/summary.txt"
step unit_tests "$bin/unit_tests"
step integration_cuda_test "$bin/integration_cuda_test"
step integration_host_test "$bin/integration_host_test"
step engine_tests "$bin/engine_tests"
step engine_cuda_test "$bin/engine_cuda_test"
step lease_allocator_test "$bin/lease_allocator_test"
step job_test "$bin/job_test"
step job_integration_test "$bin/job_integration_test"
step core_test "$bin/core_test"
step job_store_test "$bin/job_store_test"
step agent_protocol_test "$bin/agent_protocol_test"
step durability_test "$bin/durability_test"
# The job tests again with their coordinator and agents on the CUDA backend.
step job_integration_cuda env LEASEHOLD_TEST_BACKEND=cuda "$bin/job_integration_test"
step devices_cuda env LEASEHOLD_TEST_BACKEND=cuda "$bin/devices_integration_test"
step durability_cuda env LEASEHOLD_TEST_BACKEND=cuda "$bin/durability_test"
# Agents stopped with SIGSTOP while neighbours lease what the pool frees:
# on CUDA the neighbours' patterns are written and checked by kernels.
step paused_agent_cuda env LEASEHOLD_TEST_BACKEND=cuda "$bin/paused_agent_test"
# The coordinator stopped for 3 s and 8 s (and with every core busy) while
# CUDA jobs train: no attempt is interrupted; then killed and restarted.
step paused_coordinator_cuda env LEASEHOLD_TEST_BACKEND=cuda "$bin/paused_coordinator_test"
# The lease client's C interface on the CUDA backend.
step lease_client_test "$bin/lease_client_test"

demo() {
  local run; run=$(mktemp -d)
  export LEASEHOLD_ENDPOINT="ipc://$run/c.sock"
  "$bin/leasehold-coordinator" --backend cuda --mps off --pool-size 4GiB --heartbeat-interval 500ms &
  local coord=$!
  for _ in $(seq 100); do "$bin/leasehold" --timeout 200ms status >/dev/null 2>&1 && break; sleep 0.1; done
  "$bin/leasehold-agent" --name gpu-a --exercise --leases 3 --lease-size 256MiB --rounds 10 --interval 100ms &
  local a=$!
  "$bin/leasehold-agent" --name gpu-b --exercise --leases 3 --lease-size 256MiB --rounds 10 --interval 100ms &
  local b=$!
  sleep 1.5
  "$bin/leasehold" status
  "$bin/leasehold" status -o json
  wait $a && wait $b; local rc=$?
  kill -TERM $coord; wait $coord
  rm -rf "$run"
  return $rc
}
step cuda_demo demo
# PyTorch programs as program jobs, where python3 has a CUDA torch (the
# plug-in is built against it): their own log folder, their own verdict.
if python3 -c 'import torch, sys; sys.exit(0 if torch.version.cuda else 1)' 2> /dev/null; then
  step torch_program_checks env OUT="$out/torch" bash "$here/run-torch-checks.sh" "$bundle"
else
  echo "torch_program_checks: skipped (python3 has no CUDA torch)" | tee -a "$out/summary.txt"
fi
bench=${LEASEHOLD_BENCH:-all}
if [ "$bench" != none ]; then
  step bench_cuda "$bin/leasehold-bench-lease" --backend cuda --iterations 2000
  step bench_host "$bin/leasehold-bench-lease" --backend host --iterations 2000
fi
if [ "$bench" = all ]; then
  step bench_engine "$bin/leasehold-bench-engine"
  step bench_torch python3 "$here/../bench/torch_mlp_step.py"
  # PyTorch scripts with PyTorch's allocator and as program jobs (README).
  if python3 -c 'import torch, sys; sys.exit(0 if torch.version.cuda else 1)' 2> /dev/null; then
    step bench_torch_programs python3 "$here/../bench/torch_program_bench.py" --bin "$bin" \
      --python-dir "$bundle/share/leasehold/python" \
      --torch-plugin "$bundle/lib/libleasehold_torch.so" --steps 1000 --repeats 3
  fi
fi
cp "$out/bench_cuda.log" "$out/bench_cuda.json" 2>/dev/null
finish
