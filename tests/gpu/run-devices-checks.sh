#!/usr/bin/env bash
# The multi-device checks on a GPU host with two or more GPUs, from a bundle
# made by deploy/make-bundle.sh --with-tests: one coordinator serving every
# GPU (devices_integration_test on the cuda backend), the single-GPU CUDA
# integration and job tests against it unchanged, and the core's device
# tests. Logs go to $OUT (or ./gpu-logs). NCCL's NVLink multicast stays
# off, as the GPU hosts require.
#
#   bash tests/gpu/run-devices-checks.sh BUNDLE_DIR
set -uo pipefail
bundle=$(cd "${1:?usage: run-devices-checks.sh BUNDLE_DIR}" && pwd)
out=${OUT:-$PWD/gpu-logs}
mkdir -p "$out"
bin=$bundle/bin
source "$(dirname "${BASH_SOURCE[0]}")/steps.sh"
export NCCL_NVLS_ENABLE=0

nvidia-smi -L | tee "$out/summary.txt"
step devices_cuda env LEASEHOLD_TEST_BACKEND=cuda "$bin/devices_integration_test"
step devices_host "$bin/devices_integration_test"
step core_devices "$bin/core_test" --gtest_filter='Devices*'
step integration_cuda_test "$bin/integration_cuda_test"
step job_integration_cuda env LEASEHOLD_TEST_BACKEND=cuda "$bin/job_integration_test"
finish
