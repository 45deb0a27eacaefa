#!/usr/bin/env bash
# Data-parallel jobs on a GPU host with two or more GPUs, from a bundle made
# by deploy/make-bundle.sh --with-tests: the data-parallel engine tests on
# the cuda backend (NCCL) and the host backend (Gloo), the core's gang
# tests, a DDP PyTorch program job of 2 replicas (NCCL), then the
# benchmarks: a compute-heavy CNN over 1, 2, 4 GPUs (as many as there are)
# beside PyTorch DDP on the same GPUs, and 8 and 16 single-GPU jobs on one
# GPU and on every GPU. Logs go to $OUT (or ./gpu-logs). NCCL's NVLink
# multicast stays off, as the GPU hosts require.
#
#   bash tests/gpu/run-data-parallel-checks.sh BUNDLE_DIR
#
# LEASEHOLD_BENCH=none skips the benchmarks, LEASEHOLD_DP_TESTS=none the tests; LEASEHOLD_DP_EPOCHS (4),
# LEASEHOLD_DP_BATCH (256: samples per replica and step).
set -uo pipefail
bundle=$(cd "${1:?usage: run-data-parallel-checks.sh BUNDLE_DIR}" && pwd)
out=${OUT:-$PWD/gpu-logs}
mkdir -p "$out"
bin=$bundle/bin
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/steps.sh"
export NCCL_NVLS_ENABLE=0
gpus=$(nvidia-smi -L | wc -l)
epochs=${LEASEHOLD_DP_EPOCHS:-4}
batch=${LEASEHOLD_DP_BATCH:-256}

nvidia-smi -L | tee "$out/summary.txt"
if [ "${LEASEHOLD_DP_TESTS:-all}" != none ]; then
  step data_parallel_cuda env LEASEHOLD_TEST_BACKEND=cuda "$bin/data_parallel_test"
  step data_parallel_host "$bin/data_parallel_test"
  step core_gangs "$bin/core_test" --gtest_filter='Gangs*'
  step ddp_program_cuda env LEASEHOLD_TEST_BACKEND=cuda LEASEHOLD_TEST_PYTHON="$(command -v python3)" \
    "$bin/devices_integration_test" --gtest_filter='*DataParallel*'
fi

if [ "${LEASEHOLD_BENCH:-all}" != none ]; then
  counts=1
  [ "$gpus" -ge 2 ] && counts=1,2
  [ "$gpus" -ge 4 ] && counts=1,2,4
  job=$bundle/jobs/fashion-mnist-cnn.json
  step bench_data_parallel "$bin/leasehold-bench-data-parallel" --job "$job" --replicas "$counts" \
    --epochs "$epochs" --batch "$batch"
  sed -n '/^replicas/,$p' "$out/bench_data_parallel.log" | tee -a "$out/summary.txt"
  for n in ${counts//,/ }; do
    step "torch_ddp_$n" python3 "$here/../bench/torch_ddp_train.py" "$job" --replicas "$n" \
      --epochs "$epochs" --batch "$batch"
    python3 -c 'import json,sys; r=json.loads(open(sys.argv[1]).read().strip().splitlines()[-1]); print("  pytorch ddp %d replicas: %9.0f samples/s, test accuracy %.2f%%" % (r["replicas"], r["samples_per_second"], 100 * r["test_accuracy"]))' \
      "$out/torch_ddp_$n.log" | tee -a "$out/summary.txt"
  done
  # Many single-GPU jobs: on GPU 0 alone, then spread over every GPU.
  all=$(seq -s, 0 $((gpus - 1)))
  for devices in 0 "$all"; do
    label=${devices//,/_}
    step "share_devices_$label" "$bin/leasehold-bench-share" --job "$bundle/jobs/fashion-mnist-mlp.json" \
      --jobs-at-once 8,16 --epochs 3 --pool-size 8GiB --coordinator-args "--devices $devices --mps off"
    echo "devices $devices:" | tee -a "$out/summary.txt"
    sed -n '/^  jobs/,$p' "$out/share_devices_$label.log" | tee -a "$out/summary.txt"
  done
fi
finish
