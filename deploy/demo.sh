#!/usr/bin/env bash
# The main job: set up, build, then run a coordinator and two agents that
# lease memory from one pool, write and verify patterns in it, and show the
# coordinator's status view. Uses the CUDA backend when a GPU is visible.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
"$root/deploy/setup.sh"
"$root/deploy/build.sh"
bin=${LEASEHOLD_BUILD_DIR:-$root/build}/bin

run=$(mktemp -d /tmp/leasehold-demo-XXXXXX)
export LEASEHOLD_ENDPOINT="ipc://$run/coordinator.sock"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$run"
}
trap cleanup EXIT

echo "== starting leasehold-coordinator (pool ${LEASEHOLD_DEMO_POOL:-1GiB}, backend auto)"
"$bin/leasehold-coordinator" --pool-size "${LEASEHOLD_DEMO_POOL:-1GiB}" \
  --heartbeat-interval 500ms > >(sed -u 's/^/[coordinator] /') 2>&1 &
pids+=($!)
for _ in $(seq 100); do "$bin/leasehold" --timeout 200ms status >/dev/null 2>&1 && break; sleep 0.1; done

echo "== starting two agents that lease, write and verify memory"
agent_pids=()
for name in agent-a agent-b; do
  "$bin/leasehold-agent" --name "$name" --exercise --leases 3 --lease-size 64MiB \
    --rounds 10 --interval 300ms > >(sed -u "s/^/[$name] /") 2>&1 &
  agent_pids+=($!)
done
sleep 1.5
echo "== leasehold status"
"$bin/leasehold" status
status=0
for p in "${agent_pids[@]}"; do wait "$p" || status=1; done
echo "== leasehold status after the agents released their leases"
"$bin/leasehold" status
if [ $status -eq 0 ]; then echo "== demo passed: every lease verified in every round"; else echo "== demo FAILED"; fi
exit $status
