#!/usr/bin/env bash
# The occupancy policy's checks on a GPU host, from a bundle made by
# deploy/make-bundle.sh --with-tests: the core's policy tests, the
# oversubscribed jobs end to end on the CUDA backend (and on the host
# backend), the lease allocator, then the occupancy benchmark (sequential vs
# policy vs fifo at 2x and 4x). Logs go to $OUT (or ./gpu-logs).
#
#   bash tests/gpu/run-occupancy-checks.sh BUNDLE_DIR
set -uo pipefail
bundle=$(cd "${1:?usage: run-occupancy-checks.sh BUNDLE_DIR}" && pwd)
out=${OUT:-$PWD/gpu-logs}
mkdir -p "$out"
bin=$bundle/bin
source "$(dirname "${BASH_SOURCE[0]}")/steps.sh"

nvidia-smi -L | tee "$out/summary.txt"
step core_occupancy "$bin/core_test" --gtest_filter='Occupancy*'
step occupancy_cuda env LEASEHOLD_TEST_BACKEND=cuda "$bin/occupancy_integration_test"
step occupancy_host "$bin/occupancy_integration_test"
step lease_allocator_test "$bin/lease_allocator_test"
step job_integration_cuda env LEASEHOLD_TEST_BACKEND=cuda "$bin/job_integration_test"
bench() {  # bench NAME: the occupancy benchmark, its table into the summary
  step "$1" "$bin/leasehold-bench-occupancy" \
    --jobs "$bundle/jobs/fashion-mnist-mlp.json,$bundle/jobs/fashion-mnist-cnn-spill.json" \
    ${LEASEHOLD_OCCUPANCY_ARGS:-}
  sed -n '/^factor/,$p' "$out/$1.log" | tee -a "$out/summary.txt"
}
if [ "${LEASEHOLD_BENCH:-all}" != none ]; then
  bench bench_occupancy
  # Again with every process's kernels on the GPU at once: under an MPS
  # daemon of our own (pipe and log folders under /tmp), stopped afterwards.
  mps=$(command -v nvidia-cuda-mps-control || echo /usr/local/nvidia/bin/nvidia-cuda-mps-control)
  if [ -x "$mps" ]; then
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/leasehold-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/leasehold-mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    "$mps" -d && echo "MPS daemon started" | tee -a "$out/summary.txt"
    bench bench_occupancy_mps
    echo quit | "$mps"
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  fi
fi
finish
