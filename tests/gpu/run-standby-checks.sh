#!/usr/bin/env bash
# Python standbys on a GPU host (issue 29), from a bundle made by
# deploy/make-bundle.sh: builds the plug-in against this host's torch, then
# runs tests/bench/torch_standby_bench.py (cold, process and fork standbys;
# a small script, ResNet-18 and GPT-2 as program jobs; every job checked to
# have run warm where a standby was kept, and the model scripts on the
# plug-in's allocator). Logs and bench.json go to $OUT (or ./gpu-logs).
#
#   bash tests/gpu/run-standby-checks.sh BUNDLE_DIR [bench options...]
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
bundle=$(cd "${1:?usage: run-standby-checks.sh BUNDLE_DIR [bench options]}" && pwd)
shift
out=${OUT:-$PWD/gpu-logs}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
bash "$bundle/share/leasehold/torch_plugin/build.sh" "$bundle/include" "$bundle/lib" "$bundle/lib" \
  > "$out/plugin-build.log" 2>&1 || { echo "FAIL plug-in build"; tail -n 30 "$out/plugin-build.log"; exit 1; }
echo "PASS plug-in build"
python3 "$root/tests/bench/torch_standby_bench.py" --bin "$bundle/bin" \
  --python-dir "$bundle/share/leasehold/python" --torch-plugin "$bundle/lib/libleasehold_torch.so" \
  "$@" > "$out/bench.json" 2> "$out/bench.log"
rc=$?
tail -n 40 "$out/bench.log"
[ $rc -eq 0 ] && echo "PASS standby bench" || echo "FAIL standby bench"
exit $rc
