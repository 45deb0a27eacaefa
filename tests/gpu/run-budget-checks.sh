#!/usr/bin/env bash
# Budgets that fragmentation cannot break, on the GPU host: the lease
# allocator's pages shown in a chunk window on the CUDA backend (its tests,
# the wide MLP at 64 and 56 MiB, training past the budget bit for bit),
# then, side by side with OLD_BUNDLE (built before the paged allocator:
# segments of one lease each) when given, the spill benchmark at 50% and
# 25% of the CNN's peak with the host tier (step time, bytes moved, pages
# mapped; and at 20%, which neither can train in, why), the sharing
# benchmark's MLP jobs alone and eight at once and its LeNet and CNN jobs
# alone (steady-state samples/s), and the fragmentation benchmark (the
# pool's occupancy when a mix of jobs is first refused). Logs go to $OUT.
#
#   bash tests/gpu/run-budget-checks.sh BUNDLE_DIR [OLD_BUNDLE_DIR]
#
# LEASEHOLD_BUDGET_TESTS=none skips the tests, LEASEHOLD_BENCH=none the
# benchmarks.
set -uo pipefail
bundle=$(cd "${1:?usage: run-budget-checks.sh BUNDLE_DIR [OLD_BUNDLE_DIR]}" && pwd)
old=${2:+$(cd "$2" && pwd)}
out=${OUT:-$PWD/gpu-logs}
mkdir -p "$out"
bin=$bundle/bin
source "$(dirname "${BASH_SOURCE[0]}")/steps.sh"

nvidia-smi -L | tee "$out/summary.txt"
if [ "${LEASEHOLD_BUDGET_TESTS:-all}" != none ]; then
  step lease_allocator_test "$bin/lease_allocator_test"
  step budgets_cuda env LEASEHOLD_TEST_BACKEND=cuda "$bin/job_integration_test" \
    --gtest_filter='*WideMlp*:*OverItsBudget*'
  step spill_training_cuda env LEASEHOLD_TEST_BACKEND=cuda "$bin/spill_training_test"
fi
if [ "${LEASEHOLD_BENCH:-all}" != none ]; then
  spill_dir=$(mktemp -d /var/tmp/lh-budget.XXXXXX)
  for b in new ${old:+old}; do
    dir=$bundle; [ $b = old ] && dir=$old
    step "spill_bench_$b" "$dir/bin/leasehold-bench-spill" --tiers host \
      --budgets 0.5,0.25 --spill-dir "$spill_dir"
    # Below what the CNN can train in (both fail; the message says why).
    "$dir/bin/leasehold-bench-spill" --tiers host --budgets 0.2 --spill-dir "$spill_dir" \
      > "$out/spill_bench_20_$b.log" 2>&1
    echo "spill_bench_20_$b: rc=$? $(grep -h 'leasehold-bench-spill:' "$out/spill_bench_20_$b.log")"
    step "share_bench_$b" "$dir/bin/leasehold-bench-share" --job deploy/jobs/fashion-mnist-mlp.json \
      --jobs-at-once 1,8 --epochs 2
    for job in lenet cnn; do
      step "share_bench_${job}_$b" "$dir/bin/leasehold-bench-share" \
        --job "deploy/jobs/fashion-mnist-$job.json" --jobs-at-once 1 --epochs 1
    done
    step "fragmentation_bench_$b" "$dir/bin/leasehold-bench-fragmentation" --backend cuda \
      --pool-size 4GiB --seeds 7
  done
  rm -rf "$spill_dir"
  for f in "$out"/spill_bench_new.log "$out"/spill_bench_old.log; do
    echo "== $(basename "$f")" | tee -a "$out/summary.txt"
    grep -E 'unconstrained:|"budget_fraction"|leasehold-bench-spill:' "$f" |
      sed -E 's/"(bytes_moved_per_step|budget_fraction|step_ms|throughput_vs_unconstrained|peak_device_bytes|within_budget|weights_identical|evictions|restores)"/\1/g' |
      grep -oE '^unconstrained.*|leasehold-bench-spill.*|budget_fraction:[^,]*|budget_bytes[^,]*|step_ms:[^,]*|throughput_vs_unconstrained:[^,]*|bytes_moved_per_step:[^,]*|evictions:[^,]*|restores:[^,]*|peak_device_bytes:[^,]*|within_budget:[^,]*|weights_identical:[^,}]*' |
      paste -sd' ' | sed 's/ budget_fraction/\nbudget_fraction/g' | tee -a "$out/summary.txt"
  done
  for f in "$out"/share_bench_*.log; do
    echo "== $(basename "$f")" | tee -a "$out/summary.txt"
    grep -E '^ +[0-9]+ ' "$f" | tee -a "$out/summary.txt"
  done
  for f in "$out"/fragmentation_bench_*.log; do
    echo "== $(basename "$f")" | tee -a "$out/summary.txt"
    grep -E '"occupancy_' "$f" | tee -a "$out/summary.txt"
  done
fi
finish
