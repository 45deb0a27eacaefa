#!/usr/bin/env bash
# MPS faults, on the GPU host: a coordinator managing MPS (mps = on), four
# standby agents, three ordinary MLP jobs and one job named "faulty" that
# makes the GPU fault on purpose at its 700th step (the agents' hidden
# --test-device-fault-job switch). Under MPS that fault ends every agent's
# context. Checked: the ordinary jobs are requeued without being charged,
# resume from their checkpoints and succeed; the faulty job, run alone as a
# suspect, faults again and fails naming the device fault; every agent
# restarted itself and serves again; the pool (the coordinator, outside MPS)
# lived through it; then the MPS control daemon is killed and the
# coordinator starts it again, and a new job succeeds. Logs go to $OUT.
#
#   bash tests/gpu/run-mps-fault-checks.sh BUNDLE_DIR
set -uo pipefail
bundle=$(cd "${1:?usage: run-mps-fault-checks.sh BUNDLE_DIR}" && pwd)
out=${OUT:-$PWD/gpu-logs}
mkdir -p "$out"
bin=$bundle/bin
ctl=$(command -v nvidia-cuda-mps-control || echo /usr/local/nvidia/bin/nvidia-cuda-mps-control)
[ -x "$ctl" ] || { echo "no nvidia-cuda-mps-control: skipped"; exit 0; }
export PATH=$PATH:$(dirname "$ctl")
run=$(mktemp -d /tmp/lh-fault.XXXXXX)
export LEASEHOLD_ENDPOINT="ipc://$run/c.sock"
unset CUDA_MPS_PIPE_DIRECTORY
lh() { "$bin/leasehold" "$@"; }
pids=()
cleanup() {
  kill -TERM "${pids[@]}" 2>/dev/null; sleep 1; kill -KILL "${pids[@]}" 2>/dev/null
  echo quit | CUDA_MPS_PIPE_DIRECTORY="$run/mps-pipe" "$ctl" 2>/dev/null
  cp "$run"/*.log "$out/" 2>/dev/null
  cp "$run/mps-log/server.log" "$out/mps-server.log" 2>/dev/null
}
trap cleanup EXIT
"$bin/leasehold-coordinator" --backend cuda --mps on --pool-size 8GiB --state-dir "$run/state" \
  --fault-probation 5s > "$run/coordinator.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do lh --timeout 200ms status >/dev/null 2>&1 && break; sleep 0.1; done
for i in 1 2 3 4; do
  "$bin/leasehold-agent" --name "agent$i" --test-device-fault-job faulty \
    --test-device-fault-step 700 > "$run/agent$i.log" 2>&1 &
  pids+=($!)
done
ready() { [ "$(lh status -o json | grep -c '"state": "idle"')" -ge 4 ]; }
for _ in $(seq 600); do ready && break; sleep 0.1; done
lh status
python3 - "$bundle/jobs/fashion-mnist-mlp.json" "$run" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
for i in (1, 2, 3):
    k = dict(j, name="mlp-%d" % i, epochs=12)
    json.dump(k, open("%s/mlp-%d.json" % (sys.argv[2], i), "w"))
json.dump(dict(j, name="faulty", epochs=4, max_attempts=1), open(sys.argv[2] + "/faulty.json", "w"))
PY
ids=()
for f in mlp-1 mlp-2 mlp-3 faulty; do ids+=("$(lh submit "$run/$f.json" | grep -o '[0-9]\+' | head -1)"); done
echo "submitted: ${ids[*]}"
ended() {
  lh jobs -o json | python3 -c '
import json, sys
jobs = json.load(sys.stdin)
jobs = jobs.get("jobs", jobs) if isinstance(jobs, dict) else jobs
sys.exit(0 if jobs and all(j["state"] in ("succeeded", "failed", "cancelled") for j in jobs) else 1)'
}
for _ in $(seq 300); do ended && break; sleep 1; done
for id in "${ids[@]}"; do lh job "$id" -o json > "$run/job-$id.json"; done
lh status
python3 - "$run" "${ids[@]}" <<'PY'
import json, sys
run, ids = sys.argv[1], sys.argv[2:]
ok = True
def check(cond, what):
    global ok
    print(("ok:     " if cond else "FAILED: ") + what)
    ok = ok and cond
for i in ids:
    j = json.load(open("%s/job-%s.json" % (run, i)))
    print("job %s %-7s %-9s attempts %d: %s" % (i, j["name"], j["state"], j["attempts"], j["reason"][:300]))
    for a in j["attempt_history"]:
        print("    attempt %d on %s: %s, resumed from epoch %d; %s" % (a["number"], a["agent"], a["outcome"] or "-", a["resumed_from_epoch"], a["reason"][:200]))
    if j["name"] == "faulty":
        check(j["state"] == "failed", "the faulty job failed")
        check("device fault" in j["reason"], "its reason names the device fault")
        check(any(a["outcome"] == "device fault" for a in j["attempt_history"]), "a fault of its own was counted")
    else:
        check(j["state"] == "succeeded", "%s succeeded beside it" % j["name"])
        check(all(a["outcome"] in ("", "interrupted", "succeeded") for a in j["attempt_history"]),
              "%s was never charged for the fault" % j["name"])
jobs = [json.load(open("%s/job-%s.json" % (run, i))) for i in ids]
check(any(j["name"] != "faulty" and j["attempts"] > 1 for j in jobs), "the fault interrupted the ordinary jobs")
check(any(j["name"] != "faulty" and any(a["resumed_from_epoch"] > 0 for a in j["attempt_history"]) for j in jobs),
      "an interrupted job resumed from its checkpoint")
sys.exit(0 if ok else 1)
PY
jobs_ok=$?
restarts=$(grep -l "after a device fault" "$run"/agent*.log | wc -l)
echo "agents that restarted after a device fault: $restarts of 4"
grep -h "shared under MPS\|counted against\|ran alone\|without a device fault" "$run/coordinator.log" | cut -c1-240
# The MPS control daemon dies: the coordinator starts it again (it checks
# every 10 s), and a job still runs.
false_alarms=$(grep -c "starting it again" "$run/coordinator.log")
echo "daemon restarts while it was running (false alarms): $false_alarms"
pkill -KILL -f "nvidia-cuda-mps-control" ; sleep 12
grep -h "starting it again\|cannot be started\|MPS control daemon started" "$run/coordinator.log" | cut -c1-200
restarted_daemon=$(( $(grep -c "starting it again" "$run/coordinator.log") - false_alarms ))
echo get_server_list | CUDA_MPS_PIPE_DIRECTORY="$run/mps-pipe" "$ctl" >/dev/null && echo "the daemon answers again"
python3 - "$bundle/jobs/fashion-mnist-mlp.json" "$run/after.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1])); j["epochs"] = 1; j["name"] = "after-daemon-restart"
json.dump(j, open(sys.argv[2], "w"))
PY
timeout 120 "$bin/leasehold" submit "$run/after.json" --follow | tail -3; after=$?
echo "jobs: $([ $jobs_ok = 0 ] && echo PASS || echo FAIL); agents restarted: $restarts; daemon restarted: $restarted_daemon; job after: rc $after"
[ $jobs_ok = 0 ] && [ "$restarts" -ge 4 ] && [ "$false_alarms" = 0 ] && [ "$restarted_daemon" -ge 1 ] && [ $after = 0 ]
