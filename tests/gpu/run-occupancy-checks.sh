#!/usr/bin/env bash
# The occupancy policy's checks on a GPU host, from a bundle made by
# deploy/make-bundle.sh --with-tests: the core's policy tests, the
# oversubscribed jobs end to end on the CUDA backend (and on the host
# backend), the lease allocator, then the occupancy benchmark (sequential vs
# policy vs shares vs fifo at 2x and 4x). Logs go to $OUT (or ./gpu-logs).
#
#   bash tests/gpu/run-occupancy-checks.sh BUNDLE_DIR
#
# LEASEHOLD_BENCH: all (default), plain (without MPS), mps (under an MPS
# daemon of our own), none. LEASEHOLD_TESTS=0 skips the tests.
# LEASEHOLD_OCCUPANCY_ARGS: more arguments for the benchmark.
set -uo pipefail
bundle=$(cd "${1:?usage: run-occupancy-checks.sh BUNDLE_DIR}" && pwd)
out=${OUT:-$PWD/gpu-logs}
mkdir -p "$out"
bin=$bundle/bin
jobs=$bundle/jobs
source "$(dirname "${BASH_SOURCE[0]}")/steps.sh"

nvidia-smi -L | tee "$out/summary.txt"
if [ "${LEASEHOLD_TESTS:-1}" != 0 ]; then
  step core_occupancy "$bin/core_test" --gtest_filter='Occupancy*'
  step occupancy_cuda env LEASEHOLD_TEST_BACKEND=cuda "$bin/occupancy_integration_test"
  step occupancy_host "$bin/occupancy_integration_test"
  step lease_allocator_test "$bin/lease_allocator_test"
  step job_integration_cuda env LEASEHOLD_TEST_BACKEND=cuda "$bin/job_integration_test"
fi
bench() {  # bench NAME ARGS...: the occupancy benchmark, its table into the summary
  local name=$1; shift
  step "$name" "$bin/leasehold-bench-occupancy" "$@" ${LEASEHOLD_OCCUPANCY_ARGS:-}
  sed -n '/^factor/,$p' "$out/$name.log" | tee -a "$out/summary.txt"
}
# The example jobs (MLP, LeNet) and the spill benchmark's CNN, each with its
# own epochs; then the CNN-heavy mix (MLP and CNN, one epoch each), where
# the CNN's GPU time is most of the sequential time.
examples="$jobs/fashion-mnist-mlp.json,$jobs/fashion-mnist-lenet.json,$jobs/fashion-mnist-cnn-spill.json"
cnn_heavy=(--jobs "$jobs/fashion-mnist-mlp.json,$jobs/fashion-mnist-cnn-spill.json" --epochs 1
  --factors 2 --modes sequential,policy,shares)
which=${LEASEHOLD_BENCH:-all}
if [ "$which" = all ] || [ "$which" = plain ]; then
  bench bench_occupancy --jobs "$examples"
  bench bench_occupancy_cnn_heavy "${cnn_heavy[@]}"
fi
if [ "$which" = all ] || [ "$which" = mps ]; then
  # Every process's kernels on the GPU at once: under an MPS daemon of our
  # own (pipe and log folders under /tmp), stopped afterwards.
  mps=$(command -v nvidia-cuda-mps-control || echo /usr/local/nvidia/bin/nvidia-cuda-mps-control)
  if [ -x "$mps" ]; then
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/leasehold-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/leasehold-mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    "$mps" -d && echo "MPS daemon started" | tee -a "$out/summary.txt"
    bench bench_occupancy_mps --jobs "$examples" --modes sequential,policy,shares
    bench bench_occupancy_cnn_heavy_mps "${cnn_heavy[@]}"
    echo quit | "$mps"
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  else
    echo "no nvidia-cuda-mps-control: MPS runs skipped" | tee -a "$out/summary.txt"
  fi
fi
finish
