#!/usr/bin/env bash
# Runs the two example jobs (deploy/jobs/*.json, full 10 epochs) through a
# coordinator on the CUDA backend and two standby agents, from a bundle made
# by deploy/make-bundle.sh. Needs the Fashion-MNIST IDX files in
# /usr/share/datasets/fashion-mnist (Debian's dataset-fashion-mnist).
#
#   bash tests/gpu/run-example-jobs.sh BUNDLE_DIR
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
bin=$(cd "${1:?usage: run-example-jobs.sh BUNDLE_DIR}" && pwd)/bin
run=$(mktemp -d)
export LEASEHOLD_ENDPOINT="ipc://$run/c.sock"
"$bin/leasehold-coordinator" --backend cuda --mps off --pool-size 8GiB --state-dir "$run/state" &
coord=$!
for _ in $(seq 100); do "$bin/leasehold" --timeout 200ms status >/dev/null 2>&1 && break; sleep 0.1; done
"$bin/leasehold-agent" --name gpu-a & a=$!
"$bin/leasehold-agent" --name gpu-b & b=$!
sleep 2
"$bin/leasehold" submit "$root/deploy/jobs/fashion-mnist-mlp.json" --follow > "$run/mlp.log" 2>&1 &
m=$!
"$bin/leasehold" submit "$root/deploy/jobs/fashion-mnist-lenet.json" --follow > "$run/lenet.log" 2>&1 &
l=$!
wait $m; rm_=$?
wait $l; rl=$?
cat "$run/mlp.log" "$run/lenet.log"
"$bin/leasehold" jobs
"$bin/leasehold" jobs -o json
kill $a $b; wait $a $b
kill $coord; wait $coord
rm -rf "$run"
[ $rm_ -eq 0 ] && [ $rl -eq 0 ]
