#!/usr/bin/env bash
# PyTorch jobs' shared regions and spilling on a GPU host (issue 29), from a
# bundle made by deploy/make-bundle.sh: builds the plug-in against this
# host's torch, runs tests/torch/regions_probe.py twice as program jobs (the
# second attaches the first's dataset and parameters on the GPU, in place),
# then tests/bench/torch_spill_bench.py (GPT-2 small's shape at 100/50/25%
# of its peak, beside save_on_cpu; gradients bit-identical with spilling,
# also with in-order copies) and tests/bench/torch_shrink_bench.py (a
# PyTorch job shrunk for another's guarantee).
# Logs to $OUT (or ./gpu-logs).
#
#   bash tests/gpu/run-torch-extras-checks.sh BUNDLE_DIR [spill bench options...]
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
bundle=$(cd "${1:?usage: run-torch-extras-checks.sh BUNDLE_DIR}" && pwd)
shift
bin=$bundle/bin
out=${OUT:-$PWD/gpu-logs}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
fail=0
bash "$bundle/share/leasehold/torch_plugin/build.sh" "$bundle/include" "$bundle/lib" "$bundle/lib" \
  > "$out/plugin-build.log" 2>&1 || { echo "FAIL plug-in build"; tail -n 30 "$out/plugin-build.log"; exit 1; }
echo "PASS plug-in build"

run=$(mktemp -d /tmp/lh-extras.XXXXXX)
export LEASEHOLD_ENDPOINT="ipc://$run/c.sock"
"$bin/leasehold-coordinator" --backend cuda --devices 0 --pool-size 8GiB --mps off \
  --state-dir "$run/state" > "$out/coordinator.log" 2>&1 &
cpid=$!
for _ in $(seq 300); do "$bin/leasehold" --timeout 200ms status > /dev/null 2>&1 && break; sleep 0.1; done
for a in a1 a2; do
  "$bin/leasehold-agent" --name $a --python-dir "$bundle/share/leasehold/python" \
    --torch-plugin "$bundle/lib/libleasehold_torch.so" > "$out/agent-$a.log" 2>&1 &
  apids+=($!)
done
sleep 5
cd "$root"
"$bin/leasehold" run --budget 2GiB -- python3 tests/torch/regions_probe.py publish > "$out/regions-1.log" 2>&1
rc1=$?
"$bin/leasehold" run --budget 2GiB -- python3 tests/torch/regions_probe.py init > "$out/regions-2.log" 2>&1
rc2=$?
"$bin/leasehold" regions > "$out/regions-list.log" 2>&1
python3 - "$out/regions-1.log" "$out/regions-2.log" <<'PY'
import json, sys
def result(path):
    for line in open(path):
        if line.startswith("{\"built\""):
            return json.loads(line)
    sys.exit("no result in %s:\n%s" % (path, open(path).read()[-3000:]))
a, b = result(sys.argv[1]), result(sys.argv[2])
print("first:", a); print("second:", b)
ok = (a["built"] and not b["built"] and a["equal"] and b["equal"] and b["in_region"]
      and b["device"].startswith("cuda") and a["digest"] == b["digest"] and b["weights_match"]
      and a["loss"] == b["loss"])
sys.exit(0 if ok else 1)
PY
rc3=$?
if [ $rc1 -eq 0 ] && [ $rc2 -eq 0 ] && [ $rc3 -eq 0 ]; then echo "PASS regions on the GPU"; else echo "FAIL regions on the GPU"; tail -n 20 "$out"/regions-*.log; fail=1; fi
cat "$out/regions-list.log"
kill -TERM "${apids[@]}" $cpid 2>/dev/null; wait 2>/dev/null
rm -rf "$run"
unset LEASEHOLD_ENDPOINT

python3 "$root/tests/bench/torch_spill_bench.py" --bin "$bin" \
  --python-dir "$bundle/share/leasehold/python" --torch-plugin "$bundle/lib/libleasehold_torch.so" \
  "$@" > "$out/spill-bench.json" 2> "$out/spill-bench.log"
rc=$?
grep -v "^torch_spill_bench: [a-z]" "$out/spill-bench.log" | tail -n 30
[ $rc -eq 0 ] && echo "PASS spill bench" || { echo "FAIL spill bench"; tail -n 30 "$out/spill-bench.log"; fail=1; }

# The gradients again with copies in the compute's order (spill.py's other mode).
python3 "$root/tests/bench/torch_spill_bench.py" --bin "$bin" \
  --python-dir "$bundle/share/leasehold/python" --torch-plugin "$bundle/lib/libleasehold_torch.so" \
  --parts gradients --gradient-options overlap=0 \
  > "$out/spill-in-order.json" 2> "$out/spill-in-order.log"
rc=$?
grep "^gradients" "$out/spill-in-order.log"
[ $rc -eq 0 ] && echo "PASS gradients with in-order copies" || { echo "FAIL gradients with in-order copies"; tail -n 30 "$out/spill-in-order.log"; fail=1; }

python3 "$root/tests/bench/torch_shrink_bench.py" --bin "$bin" \
  --python-dir "$bundle/share/leasehold/python" --torch-plugin "$bundle/lib/libleasehold_torch.so" \
  > "$out/shrink-bench.json" 2> "$out/shrink-bench.log"
rc=$?
tail -n 2 "$out/shrink-bench.log"
[ $rc -eq 0 ] && echo "PASS shrink bench" || { echo "FAIL shrink bench"; tail -n 30 "$out/shrink-bench.log"; fail=1; }
exit $fail
