#!/usr/bin/env bash
# Many jobs on one GPU: leasehold-bench-share (N copies of a job at once on
# N standby agents; each job's step a CUDA graph) beside the PyTorch
# references (N processes, the dataset in device memory; eager, and with the
# whole step replayed as a CUDA graph), each without and then with MPS, side
# by side in one run, from a bundle made by deploy/make-bundle.sh --with-tests.
# Needs the Fashion-MNIST IDX files in /usr/share/datasets/fashion-mnist
# and PyTorch. Logs go to $OUT (or ./gpu-logs).
#
#   bash tests/gpu/run-share-checks.sh BUNDLE_DIR [JOB_NAME ...]
#
# JOB_NAME: fashion-mnist-mlp (default), fashion-mnist-lenet.
# LEASEHOLD_SHARE_AT_ONCE (1,2,4,8,16), LEASEHOLD_SHARE_EPOCHS (3),
# LEASEHOLD_SHARE_MPS (both, off, on), LEASEHOLD_SHARE_TORCH (the PyTorch
# references: "eager graph"), LEASEHOLD_SHARE_MANAGED (1: the MPS set-up check).
set -uo pipefail
bundle=$(cd "${1:?usage: run-share-checks.sh BUNDLE_DIR [JOB_NAME ...]}" && pwd)
shift
out=${OUT:-$PWD/gpu-logs}
mkdir -p "$out"
bin=$bundle/bin
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$here/steps.sh"
at_once=${LEASEHOLD_SHARE_AT_ONCE:-1,2,4,8,16}
epochs=${LEASEHOLD_SHARE_EPOCHS:-3}
which=${LEASEHOLD_SHARE_MPS:-both}
jobs=("${@:-fashion-mnist-mlp}")
torch_modes=${LEASEHOLD_SHARE_TORCH:-eager graph}
coordinator_args=()

nvidia-smi -L | tee "$out/summary.txt"
share() {  # share LABEL JOB: Leasehold, then PyTorch, for each count
  local label=$1 job=$bundle/jobs/$2.json
  step "leasehold_$label" "$bin/leasehold-bench-share" --job "$job" --jobs-at-once "$at_once" \
    --epochs "$epochs" "${coordinator_args[@]}"
  sed -n '/^  jobs/,$p' "$out/leasehold_$label.log" | tee -a "$out/summary.txt"
  local n mode
  for mode in $torch_modes; do
    for n in ${at_once//,/ }; do
      step "torch_${mode}_${label}_$n" python3 "$here/../bench/torch_train.py" "$job" \
        --epochs "$epochs" --processes "$n" $([ "$mode" = graph ] && echo --cuda-graph)
      python3 -c 'import json,sys; r=json.loads(open(sys.argv[1]).read().strip().splitlines()[-1]); print("  pytorch %-5s %3d at once: total %9.0f samples/s, min %8.0f, max %8.0f" % (sys.argv[2], r.get("processes", 1), r.get("total_samples_per_second", r.get("samples_per_second")), r.get("min", r.get("samples_per_second")), r.get("max", r.get("samples_per_second"))))' \
        "$out/torch_${mode}_${label}_$n.log" "$mode" | tee -a "$out/summary.txt"
    done
  done
}
# The coordinator managing MPS itself (mps = on): it starts the daemon
# beside its socket, agents join it at registration (one with half the
# threads), a job runs; the daemon outlives the coordinator and is stopped
# here.
mps_managed() {
  local run; run=$(mktemp -d)
  export LEASEHOLD_ENDPOINT="ipc://$run/c.sock"
  "$bin/leasehold-coordinator" --backend cuda --mps on --pool-size 8GiB --state-dir "$run/state" &
  local coord=$!
  for _ in $(seq 100); do "$bin/leasehold" --timeout 200ms status >/dev/null 2>&1 && break; sleep 0.1; done
  "$bin/leasehold-agent" --name half --mps-thread-percentage 50 > "$run/half.log" 2>&1 &
  local a=$!
  "$bin/leasehold-agent" --name whole > "$run/whole.log" 2>&1 &
  local b=$!
  for _ in $(seq 600); do
    [ "$("$bin/leasehold" status -o json | grep -c '"state": "idle"')" -ge 2 ] && break
    sleep 0.1
  done
  "$bin/leasehold" status
  python3 - "$bundle/jobs/fashion-mnist-mlp.json" "$run/one.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1])); j["epochs"] = 1
json.dump(j, open(sys.argv[2], "w"))
PY
  "$bin/leasehold" submit "$run/one.json" --follow; local rc=$?
  local ctl; ctl=$(command -v nvidia-cuda-mps-control || echo /usr/local/nvidia/bin/nvidia-cuda-mps-control)
  echo "MPS servers:"; echo get_server_list | CUDA_MPS_PIPE_DIRECTORY="$run/mps-pipe" "$ctl"
  grep -h "MPS" "$run/half.log" "$run/whole.log"
  kill -TERM $a $b; wait $a $b
  kill -TERM $coord; wait $coord
  echo "after the coordinator stopped:"; echo get_server_list | CUDA_MPS_PIPE_DIRECTORY="$run/mps-pipe" "$ctl" && echo "daemon still running (as documented)"
  echo quit | CUDA_MPS_PIPE_DIRECTORY="$run/mps-pipe" "$ctl"
  rm -rf "$run"
  unset LEASEHOLD_ENDPOINT
  return $rc
}
if [ "${LEASEHOLD_SHARE_MANAGED:-1}" = 1 ]; then step mps_managed mps_managed; fi
for j in "${jobs[@]}"; do
  if [ "$which" = both ] || [ "$which" = off ]; then share "${j}_plain" "$j"; fi
  if [ "$which" = both ] || [ "$which" = on ]; then
    mps=$(command -v nvidia-cuda-mps-control || echo /usr/local/nvidia/bin/nvidia-cuda-mps-control)
    if [ -x "$mps" ]; then
      export CUDA_MPS_PIPE_DIRECTORY=/tmp/leasehold-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/leasehold-mps-log
      mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
      "$mps" -d && echo "MPS daemon started" | tee -a "$out/summary.txt"
      # The coordinators join this daemon (mps_directory), the agents with them.
      coordinator_args=(--coordinator-args "--mps-directory $CUDA_MPS_PIPE_DIRECTORY")
      share "${j}_mps" "$j"
      coordinator_args=()
      echo quit | "$mps"
      unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    else
      echo "no nvidia-cuda-mps-control: MPS runs skipped" | tee -a "$out/summary.txt"
    fi
  fi
done
finish
