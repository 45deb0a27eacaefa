#!/usr/bin/env bash
# The engine on a GPU host (issue 30), from a bundle made by
# deploy/make-bundle.sh (with engine_cuda_test, job_test and
# spill_training_test in it):
#   tests   engine_cuda_test (every operator against the CPU, autocast, the
#           step-graph tests), the text jobs' tests (graphs vs op by op) and
#           the budgeted GPT's (recompute, then a CUDA graph in its budget)
#   gpt     tests/bench/text_gpt_bench.py: Leasehold and PyTorch side by
#           side (VARIANTS, STEPS; default all the configurations, 300 steps;
#           AGENT_LOG_LEVEL=debug also shows what is live at each traced peak)
#   seeds   the same for the loss check: 600 steps, seeds 1, 2 and 3
#   ncu     where a graphed bf16 step's GPU time goes, per kernel (ncu's CSV
#           in $OUT/ncu.csv; SKIP and COUNT launches; NCU_ARGS for other
#           sections, in $OUT/ncu.txt; NCU_JOB: another example job than
#           text-gpt, e.g. fashion-mnist-lenet, for one epoch)
#   job     the same job alone, its agent's log (LOG_LEVEL, default info)
#           in $OUT/job_agent.log. For ncu and job: BUDGET, the job's
#           memory budget (e.g. 422MiB); PROFILE_STEPS (default 60); for
#           ncu, AGENT_ARGS (e.g. --no-cuda-graphs: ncu then counts each
#           kernel of a step as a launch, not the step's one graph)
#   kernels leasehold-bench-engine (attention on float32 and bfloat16 tensors,
#           the GPT's linear layers against cuBLASLt's plain product) and
#           tests/bench/attention_torch.py (PyTorch's SDPA backends)
#   share   tests/gpu/run-share-checks.sh under MPS, 1 and 8 jobs, LeNet and MLP
# Logs and results go to $OUT (or ./gpu-logs).
#
#   bash tests/gpu/run-engine-checks.sh BUNDLE_DIR MODE [CORPUS_DIR]
#
# CORPUS_DIR: the GPT job's text files (default /usr/share/games/fortunes).
set -uo pipefail
B=$(cd "${1:?usage: run-engine-checks.sh BUNDLE_DIR MODE [CORPUS_DIR]}" && pwd)
mode=${2:?usage: run-engine-checks.sh BUNDLE_DIR MODE [CORPUS_DIR]}
corpus=${3:-/usr/share/games/fortunes}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUT=${OUT:-$PWD/gpu-logs}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
nvidia-smi -L
case $mode in
  tests)
    "$B/bin/engine_cuda_test" > "$OUT/engine_cuda.log" 2>&1
    echo "engine_cuda_test rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) +\]|Failure" "$OUT/engine_cuda.log"
    "$B/bin/job_test" --gtest_filter='TextJob*' > "$OUT/job_test.log" 2>&1
    echo "job_test rc=$?"; grep -E "^\[  (PASSED|FAILED|SKIPPED) +\]|Failure" "$OUT/job_test.log"
    LEASEHOLD_TEST_BACKEND=cuda "$B/bin/spill_training_test" --gtest_filter='SpillTraining.AGpt*:SpillTraining.AStep*' \
      > "$OUT/spill_training.log" 2>&1
    echo "spill_training_test rc=$?"
    grep -E "^\[  (PASSED|FAILED|SKIPPED) +\]|Failure|CUDA graph" "$OUT/spill_training.log" ;;
  gpt)
    python3 "$here/../bench/text_gpt_bench.py" --bin "$B/bin" --corpus-dir "$corpus" \
      --steps "${STEPS:-300}" --agent-log-level "${AGENT_LOG_LEVEL:-info}" \
      --variants "${VARIANTS:-leasehold-bf16,leasehold-bf16-op-by-op,bf16,compile,compile-graphs,graph}" \
      > "$OUT/gpt.json" 2> "$OUT/gpt.log"
    echo "text_gpt_bench rc=$?"; grep -v "^text_gpt_bench" "$OUT/gpt.log" | tail -10 ;;
  seeds)
    python3 "$here/../bench/text_gpt_bench.py" --bin "$B/bin" --corpus-dir "$corpus" \
      --steps "${STEPS:-600}" --variants "${VARIANTS:-leasehold-bf16,bf16}" --seeds 1,2,3 \
      > "$OUT/seeds.json" 2> "$OUT/seeds.log"
    echo "text_gpt_bench rc=$?"; tail -4 "$OUT/seeds.log" ;;
  ncu|job)
    T=$(mktemp -d)
    host_tier=4GiB  # the agent's pinned host tier for a job past its budget
    python3 - "$B/jobs/${NCU_JOB:-text-gpt}.json" "$T/job.json" "$corpus" "${BUDGET:-}" <<'PY'
import json, os, sys
j = json.load(open(sys.argv[1]))
j.update(checkpoint={"enabled": False}, device="cuda")
if sys.argv[4]:
    j["memory_budget"] = sys.argv[4]
if j["dataset"]["name"] == "text":
    j.update(steps=int(os.environ.get("PROFILE_STEPS", "60")), precision="BFloat16")
    j.pop("epochs", None)
    j["optimizer"]["warmup_steps"] = 10
    j["dataset"]["files"] = [os.path.join(sys.argv[3], os.path.basename(f))
                             for f in j["dataset"]["files"]]
else:
    j["epochs"] = 1
json.dump(j, open(sys.argv[2], "w"))
PY
    "$B/bin/leasehold-coordinator" --backend cuda --mps off --pool-size 16GiB \
      --endpoint "ipc://$T/c.sock" --state-dir "$T/state" > "$T/coord.log" 2>&1 &
    coord=$!
    # (Also when a time limit ends this script before the profile does.)
    trap 'kill "$coord" 2>/dev/null; rm -rf "$T"' EXIT
    sleep 2
    if [ "$mode" = job ]; then
      LD_LIBRARY_PATH="$B/lib:/usr/local/cuda/lib64" "$B/libexec/leasehold-agent" \
        --endpoint "ipc://$T/c.sock" --run-job "$T/job.json" --spill-host-bytes "$host_tier" \
        --log-level "${LOG_LEVEL:-info}" > "$OUT/job_agent.log" 2>&1
      rc=$?
      echo "agent rc=$rc"; grep -E "^result|evictions" "$OUT/job_agent.log"
      exit $rc
    fi
    ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
    # NCU_ARGS instead of the time per kernel: e.g. "--set detailed -k
    # regex:attention" (with a COUNT to match), logged to ncu.txt.
    if [ -n "${NCU_ARGS:-}" ]; then log=$OUT/ncu.txt; else log=$OUT/ncu.csv; fi
    # shellcheck disable=SC2086
    LD_LIBRARY_PATH="$B/lib:/usr/local/cuda/lib64" "$ncu" --target-processes all \
      ${NCU_ARGS:---metrics gpu__time_duration.sum --csv} \
      --launch-skip "${SKIP:-3000}" --launch-count "${COUNT:-1300}" --log-file "$log" \
      "$B/libexec/leasehold-agent" --endpoint "ipc://$T/c.sock" --run-job "$T/job.json" \
      --spill-host-bytes "$host_tier" ${AGENT_ARGS:-} > "$OUT/ncu_agent.log" 2>&1
    echo "ncu rc=$?"
    kill "$coord"; wait "$coord"; rm -rf "$T" ;;
  kernels)
    LD_LIBRARY_PATH="$B/lib:/usr/local/cuda/lib64" "$B/bin/leasehold-bench-engine" --gemm 4096 \
      > "$OUT/engine.json" 2> "$OUT/engine.log"
    echo "leasehold-bench-engine rc=$?"
    python3 "$here/../bench/attention_torch.py" > "$OUT/attention_torch.json" 2>> "$OUT/engine.log"
    echo "attention_torch rc=$?"
    python3 - "$OUT/engine.json" "$OUT/attention_torch.json" <<'PY'
import json, sys
e = json.load(open(sys.argv[1]))
print("attention", json.dumps(e["attention"]))
for l in e["linear_bf16"]:
    print("linear", json.dumps(l))
print("torch", open(sys.argv[2]).read().strip())
PY
    ;;
  share)
    LEASEHOLD_SHARE_AT_ONCE=${AT_ONCE:-1,8} LEASEHOLD_SHARE_EPOCHS=${EPOCHS:-2} \
      LEASEHOLD_SHARE_MPS=on LEASEHOLD_SHARE_MANAGED=0 \
      bash "$here/run-share-checks.sh" "$B" ${JOBS:-fashion-mnist-lenet fashion-mnist-mlp} \
      > "$OUT/share.log" 2>&1
    echo "run-share-checks rc=$?"; cat "$OUT/summary.txt" ;;
  *) echo "run-engine-checks.sh: unknown mode $mode" >&2; exit 2 ;;
esac
