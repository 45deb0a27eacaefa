#!/usr/bin/env bash
# Times N one-step jobs of the example MLP (checkpoints off) through
# `leasehold submit --follow`, submission to end with the client's own
# start-up included, on one standby agent of the bundle BUNDLE_DIR (CUDA
# backend). For builds that cannot share a benchmark program (another
# protocol version): the code before shared cache regions against the code
# after, side by side in one run. `drop` removes the dataset regions before
# each job (the dataset absent, as on a first run). Prints the times and
# their p50/p99.
#
#   bash tests/gpu/compare-start.sh BUNDLE_DIR N [drop]
set -uo pipefail
bundle=$(cd "${1:?usage: compare-start.sh BUNDLE_DIR N [drop]}" && pwd)
n=${2:?N}
drop=${3:-}
bin=$bundle/bin
run=$(mktemp -d)
export LEASEHOLD_ENDPOINT="ipc://$run/c.sock"
job=$run/one-step.json
python3 - "$bundle/jobs/fashion-mnist-mlp.json" "$job" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
j.pop("epochs", None)
j["steps"] = 1
j["checkpoint"] = {"enabled": False}
json.dump(j, open(sys.argv[2], "w"))
PY
# No MPS daemon left behind (builds that know the option).
mps=()
"$bin/leasehold-coordinator" --help 2>&1 | grep -q -- --mps && mps=(--mps off)
"$bin/leasehold-coordinator" --backend cuda "${mps[@]}" --pool-size 8GiB --state-dir "$run/state" > "$run/coordinator.log" 2>&1 &
coord=$!
for _ in $(seq 100); do "$bin/leasehold" --timeout 200ms status >/dev/null 2>&1 && break; sleep 0.1; done
"$bin/leasehold-agent" --name standby > "$run/agent.log" 2>&1 &
agent=$!
for _ in $(seq 600); do
  "$bin/leasehold" status -o json 2>/dev/null | grep -q '"state": "idle"' && break
  sleep 0.1
done
drop_regions() {
  "$bin/leasehold" regions -o json | python3 -c '
import json, sys
for r in json.load(sys.stdin)["regions"]:
    if r["name"].startswith("dataset/") and r["state"] == "ready": print(r["name"])' |
    while read -r name; do "$bin/leasehold" regions drop "$name" > /dev/null; done
}
"$bin/leasehold" submit "$job" --follow > /dev/null || { cat "$run/agent.log"; exit 1; }  # unmeasured
times=()
for _ in $(seq "$n"); do
  [ "$drop" = drop ] && drop_regions
  t0=$(date +%s%N)
  "$bin/leasehold" submit "$job" --follow > /dev/null || { cat "$run/agent.log"; exit 1; }
  t1=$(date +%s%N)
  times+=($(( (t1 - t0) / 1000 )))
done
kill -TERM $agent; wait $agent
kill -TERM $coord; wait $coord
rm -rf "$run"
printf '%s\n' "${times[@]}" | sort -n | awk -v label="$(basename "$bundle")${drop:+ (regions dropped)}" '
  { v[NR] = $1 / 1000.0; printf "%.1f ", v[NR] }
  END { p50 = v[int(0.5 * (NR - 1) + 1.5)]; p99 = v[int(0.99 * (NR - 1) + 1.5)];
        printf "\n%s: %d jobs, submit -> done (client included) p50 %.1f ms, p99 %.1f ms\n", label, NR, p50, p99 }'
