#!/usr/bin/env bash
# Many jobs on one GPU: leasehold-bench-share (N copies of a job at once on
# N standby agents) beside the PyTorch eager reference (N processes, the
# dataset in device memory), each without and then with MPS, side by side
# in one run, from a bundle made by deploy/make-bundle.sh --with-tests.
# Needs the Fashion-MNIST IDX files in /usr/share/datasets/fashion-mnist
# and PyTorch. Logs go to $OUT (or ./gpu-logs).
#
#   bash tests/gpu/run-share-checks.sh BUNDLE_DIR [JOB_NAME ...]
#
# JOB_NAME: fashion-mnist-mlp (default), fashion-mnist-lenet.
# LEASEHOLD_SHARE_AT_ONCE (1,2,4,8,16), LEASEHOLD_SHARE_EPOCHS (3),
# LEASEHOLD_SHARE_MPS (both, off, on).
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

nvidia-smi -L | tee "$out/summary.txt"
share() {  # share LABEL JOB: Leasehold, then PyTorch, for each count
  local label=$1 job=$bundle/jobs/$2.json
  step "leasehold_$label" "$bin/leasehold-bench-share" --job "$job" --jobs-at-once "$at_once" \
    --epochs "$epochs"
  sed -n '/^  jobs/,$p' "$out/leasehold_$label.log" | tee -a "$out/summary.txt"
  local n
  for n in ${at_once//,/ }; do
    step "torch_${label}_$n" python3 "$here/../bench/torch_train.py" "$job" --epochs "$epochs" \
      --processes "$n"
    python3 -c 'import json,sys; r=json.loads(open(sys.argv[1]).read().strip().splitlines()[-1]); print("  pytorch %3d at once: total %9.0f samples/s, min %8.0f, max %8.0f" % (r.get("processes", 1), r.get("total_samples_per_second", r.get("samples_per_second")), r.get("min", r.get("samples_per_second")), r.get("max", r.get("samples_per_second"))))' \
      "$out/torch_${label}_$n.log" | tee -a "$out/summary.txt"
  done
}
for j in "${jobs[@]}"; do
  if [ "$which" = both ] || [ "$which" = off ]; then share "${j}_plain" "$j"; fi
  if [ "$which" = both ] || [ "$which" = on ]; then
    mps=$(command -v nvidia-cuda-mps-control || echo /usr/local/nvidia/bin/nvidia-cuda-mps-control)
    if [ -x "$mps" ]; then
      export CUDA_MPS_PIPE_DIRECTORY=/tmp/leasehold-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/leasehold-mps-log
      mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
      "$mps" -d && echo "MPS daemon started" | tee -a "$out/summary.txt"
      share "${j}_mps" "$j"
      echo quit | "$mps"
      unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    else
      echo "no nvidia-cuda-mps-control: MPS runs skipped" | tee -a "$out/summary.txt"
    fi
  fi
done
finish
