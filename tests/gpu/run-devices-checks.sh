#!/usr/bin/env bash
# The multi-device checks on a GPU host with two or more GPUs, from a bundle
# made by deploy/make-bundle.sh --with-tests: one coordinator serving every
# GPU (devices_integration_test on the cuda backend), the single-GPU CUDA
# integration and job tests against it unchanged, the core's device tests,
# and (where python3 has a CUDA torch) a PyTorch program job pinned to each
# GPU. Logs go to $OUT (or ./gpu-logs). NCCL's NVLink multicast stays off,
# as the GPU hosts require.
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

# A PyTorch program job pinned to each GPU in turn: the program sees only
# its GPU (as cuda:0), its tensors come from that GPU's pool, and the GPU
# is the one asked for (its UUID, as nvidia-smi says).
program_on_each_gpu() {
  local run; run=$(mktemp -d /tmp/lh-devices.XXXXXX)
  export LEASEHOLD_ENDPOINT="ipc://$run/c.sock"
  "$bin/leasehold-coordinator" --backend cuda --pool-size 4GiB --mps off --http off \
    --state-dir "$run/state" > "$run/coordinator.log" 2>&1 &
  local pids=($!)
  for _ in $(seq 300); do "$bin/leasehold" --timeout 200ms status > /dev/null 2>&1 && break; sleep 0.1; done
  local gpus; gpus=$(nvidia-smi -L | wc -l)
  for i in $(seq "$gpus"); do
    "$bin/leasehold-agent" --name "a$i" > "$run/agent$i.log" 2>&1 &
    pids+=($!)
  done
  for _ in $(seq 600); do
    [ "$("$bin/leasehold" status -o json | grep -c '"state": "idle"')" -ge "$gpus" ] && break
    sleep 0.1
  done
  "$bin/leasehold" status
  local rc=0
  for g in $(seq 0 $((gpus - 1))); do
    local want; want=$(nvidia-smi --query-gpu=uuid --format=csv,noheader -i "$g")
    "$bin/leasehold" run --budget 1GiB --device "cuda:$g" --name "on-gpu$g" -- python3 -c 'import torch, leasehold.torch as lt; x = torch.ones(64 << 20, dtype=torch.uint8, device="cuda"); torch.cuda.synchronize(); print("visible", torch.cuda.device_count(), "uuid GPU-%s" % torch.cuda.get_device_properties(0).uuid, "leased", lt.stats()["leased_bytes"] >> 20, "MiB")' > "$run/gpu$g.out" 2>&1 || rc=1
    cat "$run/gpu$g.out"
    grep -q "visible 1 uuid $want leased [1-9]" "$run/gpu$g.out" || { echo "GPU $g: expected $want"; rc=1; }
  done
  [ $rc -eq 0 ] || for f in "$run"/*.log; do echo "--- $f"; tail -n 30 "$f"; done
  kill -TERM "${pids[@]}" 2>/dev/null; wait
  rm -rf "$run"
  return $rc
}
if python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  bash "$bundle/share/leasehold/torch_plugin/build.sh" "$bundle/include" "$bundle/lib" "$bundle/lib" \
    > "$out/plugin_build.log" 2>&1 || echo "plug-in build failed (plugin_build.log)"
  step program_on_each_gpu program_on_each_gpu
fi
finish
