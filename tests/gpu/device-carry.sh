#!/usr/bin/env bash
# Takes run-engine-checks.sh to a lent GPU host that has no Debian packages:
#
#   tests/gpu/device-carry.sh pack [DIR]   here, after building with CUDA:
#       a bundle of the programs the engine checks need (make-bundle.sh),
#       the Fashion-MNIST files and the fortunes corpus, in DIR
#       (default .device-carry, which git ignores), xz-compressed
#   tests/gpu/device-carry.sh run [DIR]    there, from the repository root:
#       unpacks DIR, puts the datasets where the example jobs read them,
#       and runs run-engine-checks.sh for each of $MODES (default "tests
#       gpt"), each under a limit of $TMO seconds (default 420)
#
# run-engine-checks.sh's own variables (VARIANTS, STEPS, SKIP, COUNT,
# NCU_ARGS, NCU_JOB, AT_ONCE, JOBS, ...) pass through; logs go to $OUT.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
verb=${1:?usage: device-carry.sh pack|run [DIR]}
dir=${2:-$root/.device-carry}
programs=(leasehold leasehold-agent leasehold-coordinator engine_cuda_test job_test
  spill_training_test leasehold-bench-engine leasehold-bench-share)
case $verb in
  pack)
    set -e
    mkdir -p "$dir"
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    LEASEHOLD_BUILD_DIR=${LEASEHOLD_BUILD_DIR:-$root/build} \
      bash "$root/deploy/make-bundle.sh" "$tmp/bundle" "${programs[@]}" > "$tmp/bundle.log"
    tar -C "$tmp" -cf - bundle | xz -T2 -6 > "$dir/bundle.tar.xz"
    # The dataset files are gzip already; the corpus is small.
    tar -C / -cf "$dir/data.tar" usr/share/datasets/fashion-mnist usr/share/games/fortunes
    du -sh "$dir"/* ;;
  run)
    set -e
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    xz -dc "$dir/bundle.tar.xz" | tar -C "$work" -xf -
    tar -C / -xf "$dir/data.tar"
    set +e
    rc=0
    for mode in ${MODES:-tests gpt}; do
      echo "=== $mode"
      timeout "${TMO:-420}" bash "$root/tests/gpu/run-engine-checks.sh" "$work/bundle" "$mode" \
        || rc=1
    done
    exit $rc ;;
  *) echo "device-carry.sh: unknown verb $verb (pack or run)" >&2; exit 2 ;;
esac
