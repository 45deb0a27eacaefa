#!/usr/bin/env bash
# The spill store's checks on a GPU host, from a bundle made by
# deploy/make-bundle.sh --with-tests: the store's own tests (the CUDA copy
# stream included), training past the budget bit for bit on the host and
# CUDA backends, the lease allocator and the CUDA operators (conv2d works
# through the batch in chunks), then the raw disk and the spill benchmark
# side by side. Logs go to $OUT (or ./gpu-logs).
#
#   bash tests/gpu/run-spill-checks.sh BUNDLE_DIR [SPILL_DIR]
set -uo pipefail
bundle=$(cd "${1:?usage: run-spill-checks.sh BUNDLE_DIR [SPILL_DIR]}" && pwd)
spill_dir=${2:-/var/tmp/leasehold-spill-bench}
out=${OUT:-$PWD/gpu-logs}
mkdir -p "$out" "$spill_dir"
bin=$bundle/bin
source "$(dirname "${BASH_SOURCE[0]}")/steps.sh"

nvidia-smi -L | tee "$out/summary.txt"
df -hT "$spill_dir" | tee -a "$out/summary.txt"
step spill_store_test "$bin/spill_store_test"
step spill_training_host "$bin/spill_training_test"
step spill_training_cuda env LEASEHOLD_TEST_BACKEND=cuda "$bin/spill_training_test"
step lease_allocator_test "$bin/lease_allocator_test"
step engine_cuda_test "$bin/engine_cuda_test"
step engine_tests "$bin/engine_tests"
step job_test "$bin/job_test"

# Raw disk bandwidth of the spill directory with O_DIRECT in 1 MiB blocks:
# one dd stream (one request at a time), then four at once (the spill
# store's I/O threads keep four requests in flight), 1 GiB each.
raw_disk() {
  local f=$spill_dir/dd-raw i t0 t1 t2
  dd if=/dev/zero of="$f-0" bs=1M count=2048 oflag=direct conv=fsync 2>&1 | tail -1
  dd if="$f-0" of=/dev/null bs=1M iflag=direct 2>&1 | tail -1
  t0=$(date +%s%N)
  for i in 1 2 3 4; do dd if=/dev/zero of="$f-$i" bs=1M count=1024 oflag=direct conv=fsync 2>/dev/null & done
  wait
  t1=$(date +%s%N)
  for i in 1 2 3 4; do dd if="$f-$i" of=/dev/null bs=1M iflag=direct 2>/dev/null & done
  wait
  t2=$(date +%s%N)
  awk -v w=$((t1 - t0)) -v r=$((t2 - t1)) 'BEGIN {
    printf "4 streams: write %.2f GB/s, read %.2f GB/s\n", 4 * 2^30 / w, 4 * 2^30 / r }'
  rm -f "$f"-*
}
step raw_disk raw_disk
cat "$out/raw_disk.log" | tee -a "$out/summary.txt"
if [ "${LEASEHOLD_BENCH:-all}" != none ]; then
  step bench_spill "$bin/leasehold-bench-spill" --job "$bundle/jobs/fashion-mnist-cnn-spill.json" \
    --spill-dir "$spill_dir" --pool-size 24GiB
  grep -E '^\{"budget|^unconstrained' "$out/bench_spill.log" | tee -a "$out/summary.txt"
fi
finish
