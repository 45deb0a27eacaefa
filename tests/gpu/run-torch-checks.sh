#!/usr/bin/env bash
# PyTorch programs as program jobs, on a GPU host with a CUDA PyTorch (issue
# 25), from a bundle made by deploy/make-bundle.sh:
#   - builds the plug-in against this host's torch (the bundle's
#     share/leasehold/torch_plugin/build.sh) into the bundle's lib/, where
#     agents find it;
#   - runs tests/torch/train.py (LeNet, ResNet-18, a GPT-2 built from a config,
#     deterministic kernels) without Leasehold and as a program job: the same
#     loss curve bit for bit, every
#     tensor from leases (the program's own device memory, as the agent
#     measures it, stays at its CUDA context);
#   - torch.OutOfMemoryError past the budget (tests/torch/oom_probe.py), and
#     a probe's cached memory handed back on a Shrink when another job needs it;
#   - the traps of a pluggable allocator (tests/torch/traps.py: cudnn.benchmark,
#     record_stream, reuse across streams, non_blocking copies, CUDA graphs),
#     and the MemPool layering measured;
#   - two PyTorch jobs and two engine jobs side by side; eight PyTorch jobs
#     under the coordinator's MPS daemon.
# Logs (one per step) and summary.txt go to $OUT (or ./gpu-logs).
#
#   bash tests/gpu/run-torch-checks.sh BUNDLE_DIR
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
bundle=$(cd "${1:?usage: run-torch-checks.sh BUNDLE_DIR}" && pwd)
bin=$bundle/bin
out=${OUT:-$PWD/gpu-logs}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
py=$(command -v python3)
source "$root/tests/gpu/steps.sh"
train=$root/tests/torch/train.py
probe=$root/tests/torch/oom_probe.py

lh() { "$bin/leasehold" "$@"; }
run=""
pids=()
stop_cluster() {
  [ ${#pids[@]} -gt 0 ] && kill -TERM "${pids[@]}" 2>/dev/null
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null; done
  pids=()
  if [ -n "$run" ]; then
    if [ -S "$run/mps-pipe/control" ] || [ -d "$run/mps-pipe" ]; then
      echo quit | CUDA_MPS_PIPE_DIRECTORY="$run/mps-pipe" nvidia-cuda-mps-control 2>/dev/null
    fi
    rm -rf "$run"
  fi
  run=""
}
trap stop_cluster EXIT
# start_cluster POOL AGENTS [coordinator options...]: agents named a1..aN,
# each finding the Python package and the plug-in beside its own binary.
start_cluster() {
  local pool=$1 agents=$2; shift 2
  run=$(mktemp -d /tmp/lh-torch.XXXXXX)
  export LEASEHOLD_ENDPOINT="ipc://$run/c.sock"
  "$bin/leasehold-coordinator" --backend cuda --devices 0 --pool-size "$pool" --state-dir "$run/state" \
    "$@" > "$run/coordinator.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 300); do lh --timeout 200ms status > /dev/null 2>&1 && break; sleep 0.1; done
  for i in $(seq "$agents"); do
    "$bin/leasehold-agent" --name "a$i" > "$run/agent$i.log" 2>&1 &
    pids+=($!)
  done
  for _ in $(seq 600); do
    [ "$(lh status -o json | grep -c '"state": "idle"')" -ge "$agents" ] && return 0
    sleep 0.1
  done
  echo "agents did not become idle"; cat "$run"/*.log; return 1
}
logs_of_cluster() { for f in "$run"/*.log; do echo "--- $(basename "$f")"; tail -n 40 "$f"; done; }
job_id_of() { sed -n "s/^leasehold: job \([0-9][0-9]*\) '.*' submitted$/\1/p" "$1" | head -n 1; }

# compare PLAIN_OUTPUT LEASEHOLD_OUTPUT JOB_JSON: the same loss at every
# logged step (up to float reassociation), the program's own device memory
# no more than a CUDA context's, and its plug-in's figures.
compare() {
  "$py" - "$@" <<'PY'
import json, sys
def lines(path):
    out = []
    for line in open(path, errors="replace"):
        line = line.strip()
        if line.startswith("{"):
            try: out.append(json.loads(line))
            except ValueError: pass
    return out
plain, lease = lines(sys.argv[1]), lines(sys.argv[2])
job = json.load(open(sys.argv[3]))
curve = lambda ls: {l["step"]: l["loss"] for l in ls if "step" in l and "loss" in l}
a, b = curve(plain), curve(lease)
common = sorted(set(a) & set(b))
assert common, "no common logged steps"
# Both runs use deterministic kernels (train.py --deterministic): the
# losses are the same bit for bit (measured on an H100: 0 for all three
# models), so any difference is the memory's. Without them cuDNN's atomics
# alone moved LeNet's by up to 4% (relative, losses below 0.01 compared
# absolutely).
worst = max(abs(a[s] - b[s]) / max(abs(a[s]), 1e-2) for s in common)
sa = [l for l in plain if l.get("type") == "summary"][-1]
sb = [l for l in lease if l.get("type") == "summary"][-1]
m = job.get("program_memory", {})
print("steps compared: %d, worst relative loss difference %.2e" % (len(common), worst))
print("final loss: plain %.5f, leasehold %.5f" % (sa["final_loss"], sb["final_loss"]))
print("steps/s: plain %.1f, leasehold %.1f (%.3fx)" % (sa["steps_per_second"], sb["steps_per_second"],
      sb["steps_per_second"] / sa["steps_per_second"]))
print("peak: plain %.1f MiB reserved, leasehold %.1f MiB leased" % (sa["peak_device_bytes"] / 2**20,
      m.get("peak_leased_bytes", 0) / 2**20))
print("program memory: %s" % json.dumps(m))
ok = worst <= 1e-6
outside = m.get("outside_pool_bytes", 0)
if outside:
    # The CUDA context (code, kernels, the runtime) is hundreds of MiB; any
    # tensor memory outside the leases would add the model's peak to it.
    print("program's own device memory outside the pool: %.1f MiB" % (outside / 2**20))
    ok = ok and outside < 1536 * 2**20
else:
    print("NVML gave no per-process figure (MPS or a PID namespace): not checked")
ok = ok and m.get("peak_leased_bytes", 0) > 0 and job["state"] == "succeeded"
print("OK" if ok else "MISMATCH")
sys.exit(0 if ok else 1)
PY
}

# plain_and_job NAME MODEL STEPS BUDGET: the script alone, then as a job.
plain_and_job() {
  local name=$1 model=$2 steps=$3 budget=$4
  # Deterministic kernels both ways: cuDNN's atomics alone move two plain
  # LeNet runs' losses by up to 1e-3 relative, two job runs' by 5e-3.
  "$py" "$train" --model "$model" --steps "$steps" --log-every 10 --deterministic \
    > "$run/$name-plain.out" 2>&1 || { cat "$run/$name-plain.out"; return 1; }
  lh run --budget "$budget" --name "$name" -- "$py" "$train" --model "$model" --steps "$steps" \
    --log-every 10 --deterministic > "$run/$name-job.out" 2>&1
  local rc=$?
  tail -n 3 "$run/$name-job.out"
  [ $rc -eq 0 ] || { cat "$run/$name-job.out"; logs_of_cluster; return 1; }
  local id; id=$(job_id_of "$run/$name-job.out")
  lh job "$id"
  lh job "$id" -o json > "$run/$name-job.json"
  compare "$run/$name-plain.out" "$run/$name-job.out" "$run/$name-job.json"
}

plugin() {
  bash "$bundle/share/leasehold/torch_plugin/build.sh" "$bundle/include" "$bundle/lib" "$bundle/lib"
}
scripts_as_jobs() {
  start_cluster 24GiB 1 --mps off || return 1
  local rc=0
  plain_and_job lenet lenet 300 2GiB || rc=1
  plain_and_job resnet18 resnet18 150 8GiB || rc=1
  plain_and_job gpt2 gpt2 150 12GiB || rc=1
  grep -h "program\|plug-in\|outside the pool" "$run/agent1.log" | cut -c1-200 | tail -n 8
  stop_cluster
  return $rc
}
out_of_memory() {
  start_cluster 8GiB 1 --mps off || return 1
  lh run --budget 1GiB --name oom -- "$py" "$probe"
  local rc=$?
  [ $rc -eq 0 ] || logs_of_cluster
  stop_cluster
  return $rc
}
# A probe caches half its budget, more than its guaranteed part; a second job
# then needs more than the pool has free: the coordinator sends the probe a
# Shrink, its plug-in gives cached memory back, and the second job gets it.
shrink() {
  start_cluster 4GiB 2 --mps off || return 1
  # Guaranteed 512 MiB of its 3 GiB: the rest the policy may ask back.
  lh run --budget 3GiB --min 512MiB --name cacher -- "$py" "$probe" --wait-shrink 90 \
    > "$run/cacher.out" 2>&1 &
  local cacher=$!
  for _ in $(seq 900); do grep -q '"phase": "cached"' "$run/cacher.out" && break; sleep 0.1; done
  grep '"phase"' "$run/cacher.out"
  lh status
  # 64 MiB at a time (freed leases of the cacher need not be adjacent); one
  # line: a job's command arguments are single-line text.
  lh run --budget 3GiB --name taker -- "$py" -c 'import torch, leasehold.torch as lt; xs = [torch.ones(64 << 20, dtype=torch.uint8, device="cuda") for _ in range(44)]; torch.cuda.synchronize(); print("taker got", sum(x.numel() for x in xs) >> 20, "MiB; leased", lt.stats()["leased_bytes"] >> 20, "MiB")'
  local rt=$?
  wait $cacher; local rc=$?
  cat "$run/cacher.out" | tail -n 5
  grep -h "Shrink\|shrink" "$run/coordinator.log" | cut -c1-220 | tail -n 6
  [ $rt -eq 0 ] && [ $rc -eq 0 ] || { logs_of_cluster; stop_cluster; return 1; }
  stop_cluster
}
# PyTorch features a pluggable allocator can get wrong (tests/torch/traps.py),
# and the layering not chosen, measured (tests/torch/mempool_layering.py).
traps() {
  start_cluster 8GiB 1 --mps off || return 1
  lh run --budget 2GiB --name traps -- "$py" "$root/tests/torch/traps.py" > "$run/traps.out" 2>&1
  local rc=$?
  cat "$run/traps.out"
  [ "$(grep -c 'cudnn.benchmark stays off' "$run/traps.out")" -eq 1 ] || { echo "no single cudnn line"; rc=1; }
  [ $rc -eq 0 ] || logs_of_cluster
  stop_cluster
  "$py" "$root/tests/torch/mempool_layering.py" --model resnet18 || rc=1
  return $rc
}
# engine_job_files NAME...: the LeNet job file, on Fashion-MNIST-shaped IDX
# files (the GPU host has no dataset), as $run/NAME.json.
engine_job_files() {
  "$py" - "$run/data" "$root/deploy/jobs/fashion-mnist-lenet.json" "$@" <<'PY'
import json, os, struct, sys
import numpy as np
d, lenet, names = sys.argv[1], sys.argv[2], sys.argv[3:]
os.makedirs(d, exist_ok=True)
rng = np.random.default_rng(0)
def write(prefix, n):
    labels = rng.integers(0, 10, n).astype(np.uint8)
    protos = np.random.default_rng(1).integers(0, 256, (10, 28, 28))
    images = np.clip(protos[labels] + rng.normal(0, 40, (n, 28, 28)), 0, 255).astype(np.uint8)
    open(f"{d}/{prefix}-images", "wb").write(struct.pack(">IIII", 0x803, n, 28, 28) + images.tobytes())
    open(f"{d}/{prefix}-labels", "wb").write(struct.pack(">II", 0x801, n) + labels.tobytes())
write("train", 20000); write("test", 2000)
job = json.load(open(lenet))
job["dataset"] = {"train_images": f"{d}/train-images", "train_labels": f"{d}/train-labels",
                  "test_images": f"{d}/test-images", "test_labels": f"{d}/test-labels"}
job["epochs"] = 3
for name in names:
    job["name"] = name
    json.dump(job, open(f"{os.path.dirname(d)}/{name}.json", "w"))
PY
}
side_by_side() {
  start_cluster 8GiB 4 --mps off || return 1
  engine_job_files engine1 engine2 || return 1
  local jobs=()
  for i in 1 2; do
    lh run --budget 1GiB --name "torch$i" -- "$py" "$train" --model lenet --steps 3000 \
      --log-every 100 > "$run/torch$i.out" 2>&1 &
    jobs+=($!)
    lh submit "$run/engine$i.json" --follow > "$run/engine$i.out" 2>&1 &
    jobs+=($!)
  done
  sleep 12
  lh status
  lh jobs
  local rc=0
  for j in "${jobs[@]}"; do wait "$j" || rc=1; done
  lh jobs
  for f in "$run"/torch*.out "$run"/engine*.out; do echo "--- $f"; tail -n 2 "$f"; done
  [ $rc -eq 0 ] || logs_of_cluster
  stop_cluster
  return $rc
}
under_mps() {
  command -v nvidia-cuda-mps-control > /dev/null || export PATH=$PATH:/usr/local/nvidia/bin
  command -v nvidia-cuda-mps-control > /dev/null || { echo "no nvidia-cuda-mps-control: skipped"; return 0; }
  unset CUDA_MPS_PIPE_DIRECTORY
  start_cluster 24GiB 8 --mps on || return 1
  local jobs=() rc=0
  for i in $(seq 8); do
    lh run --budget 2GiB --name "mps$i" -- "$py" "$train" --model lenet --steps 1000 \
      --log-every 100 > "$run/mps$i.out" 2>&1 &
    jobs+=($!)
  done
  sleep 15
  lh status
  for j in "${jobs[@]}"; do wait "$j" || rc=1; done
  lh jobs
  for f in "$run"/mps*.out; do tail -n 1 "$f" | cut -c1-200; done
  grep -h "MPS\|mps" "$run/coordinator.log" | cut -c1-200 | head -n 5
  [ $rc -eq 0 ] || logs_of_cluster
  stop_cluster
  return $rc
}

nvidia-smi -L | tee -a "$out/summary.txt"
"$py" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)' | tee -a "$out/summary.txt"
# LEASEHOLD_TORCH_CHECKS: which checks to run (default all of them).
checks=${LEASEHOLD_TORCH_CHECKS:-scripts_as_jobs out_of_memory shrink traps side_by_side under_mps}
step torch_plugin_build plugin
if [ $failed -eq 0 ]; then
  for c in $checks; do step "torch_$c" "$c"; done
fi
finish
