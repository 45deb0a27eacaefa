#!/usr/bin/env bash
# The main job: set up, build, then start a coordinator and two standby
# agents, submit the Fashion-MNIST MLP and LeNet jobs together, follow their
# progress and print each job's final test accuracy and throughput, then stop
# everything. Uses the CUDA backend when a GPU is visible, else the host one.
#
# On a CPU-only machine LeNet runs LEASEHOLD_DEMO_LENET_EPOCHS epochs
# (default 3) so the demo stays well under 10 minutes on 2 cores; the MLP
# runs its full 10 epochs. The README lists what the full jobs reach.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/deploy/setup.sh"
"$root/deploy/build.sh"
bin=${LEASEHOLD_BUILD_DIR:-$root/build}/bin

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  backend=cuda; lenet_epochs=${LEASEHOLD_DEMO_LENET_EPOCHS:-10}
else
  backend=host; lenet_epochs=${LEASEHOLD_DEMO_LENET_EPOCHS:-3}
fi

run=$(mktemp -d /tmp/leasehold-demo-XXXXXX)
export LEASEHOLD_ENDPOINT="ipc://$run/coordinator.sock"
pids=()
cleanup() {
  # Agents first, then the coordinator.
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do kill "${pids[$i]}" 2>/dev/null || true; done
  wait 2>/dev/null || true
  # The MPS daemon the coordinator started beside its socket (mps = auto on
  # a GPU host with nvidia-cuda-mps-control) outlives it on purpose; the
  # demo's folder goes, so the daemon goes too.
  if [ -e "$run/mps-pipe/control" ]; then
    echo quit | CUDA_MPS_PIPE_DIRECTORY="$run/mps-pipe" nvidia-cuda-mps-control || true
  fi
  rm -rf "$run"
}
trap cleanup EXIT

http=${LEASEHOLD_DEMO_HTTP:-127.0.0.1:9464}
echo "== starting leasehold-coordinator (backend $backend, pool ${LEASEHOLD_DEMO_POOL:-2GiB})"
[ "$http" != off ] && echo "   dashboard: http://$http/ (LEASEHOLD_DEMO_HTTP=HOST:PORT or off)"
# A fresh state directory per run: the demo's jobs are 1 and 2.
"$bin/leasehold-coordinator" --backend "$backend" --pool-size "${LEASEHOLD_DEMO_POOL:-2GiB}" \
  --state-dir "$run/state" --http "$http" \
  > >(sed -u 's/^/[coordinator] /') 2>&1 &
pids+=($!)
for _ in $(seq 100); do "$bin/leasehold" --timeout 200ms status >/dev/null 2>&1 && break; sleep 0.1; done

echo "== starting two standby agents"
for name in agent-a agent-b; do
  "$bin/leasehold-agent" --name "$name" > >(sed -u "s/^/[$name] /") 2>&1 &
  pids+=($!)
done
for _ in $(seq 100); do
  [ "$("$bin/leasehold" status -o json | grep -c '"state": "idle"')" -ge 2 ] && break
  sleep 0.1
done
"$bin/leasehold" status

echo "== submitting the MLP (10 epochs) and LeNet ($lenet_epochs epochs) jobs"
"$bin/leasehold" submit "$root/deploy/jobs/fashion-mnist-mlp.json" --follow \
  > >(sed -u 's/^/[mlp] /') 2>&1 &
mlp=$!
"$bin/leasehold" submit "$root/deploy/jobs/fashion-mnist-lenet.json" --epochs "$lenet_epochs" \
  --follow > >(sed -u 's/^/[lenet] /') 2>&1 &
lenet=$!
status=0
wait "$mlp" || status=1
wait "$lenet" || status=1
sleep 0.2
echo "== jobs"
"$bin/leasehold" jobs
for id in 1 2; do "$bin/leasehold" job "$id" | sed -n '1p;/result/p'; done
if [ $status -eq 0 ]; then echo "== demo passed"; else echo "== demo FAILED"; fi
exit $status
