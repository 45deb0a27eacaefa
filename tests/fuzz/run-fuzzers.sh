#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan + UBSan + libFuzzer) from the
# sources they need, and runs each for SECONDS (default 60) on a copy of its
# seed corpus. Exits non-zero on any crash, leak or sanitizer report; the
# crashing input is kept in OUT/. Prints each target's executions.
#   tests/fuzz/run-fuzzers.sh BUILD_DIR [SECONDS]     (after deploy/build.sh)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=$(cd "${1:?usage: run-fuzzers.sh BUILD_DIR [SECONDS]}" && pwd)
seconds=${2:-60}
out=$build/fuzz
mkdir -p "$out"
cxx=$(command -v clang++-14 || command -v clang++ || true)
if [ -z "$cxx" ]; then
  echo "run-fuzzers: clang++ not found (deploy/setup.sh --with-test-tools installs clang)" >&2
  exit 1
fi
flags=(-std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all
       -I"$root" -I"$build/generated" $(pkg-config --cflags libzmq))
declare -A sources=(
  [envelope_fuzzer]="shared/protocol.cpp"
  # leasehold_jobspec's sources (shared/CMakeLists.txt) and the leasehold_common parts they use.
  [job_file_fuzzer]="shared/job_spec.cpp shared/job_validation.cpp shared/text_dataset_checks.cpp shared/layer_shapes.cpp shared/idx_file.cpp shared/checkpoint_folder.cpp shared/program_spec.cpp shared/file_system.cpp shared/status.cpp shared/units.cpp shared/region_names.cpp shared/printable.cpp"
)
declare -A libs=([envelope_fuzzer]="-lzmq -lflatbuffers" [job_file_fuzzer]="-lzmq -lflatbuffers -lz -lfmt")
status=0
for target in envelope_fuzzer job_file_fuzzer; do
  srcs=()
  for s in ${sources[$target]}; do srcs+=("$root/$s"); done
  "$cxx" "${flags[@]}" "$root/tests/fuzz/$target.cpp" "${srcs[@]}" ${libs[$target]} \
    -o "$out/$target"
  corpus=$out/$target-corpus
  rm -rf "$corpus" && mkdir -p "$corpus"
  cp "$root/tests/fuzz/corpus/${target%_fuzzer}"/* "$corpus/"
  echo "== $target: ${seconds} s"
  if ! (cd "$out" && ASAN_OPTIONS=detect_leaks=1 "./$target" -max_total_time="$seconds" \
          -print_final_stats=1 -max_len=65536 -artifact_prefix="$out/$target-" "$corpus" \
          > "$out/$target.log" 2>&1); then
    echo "run-fuzzers: $target FAILED; input and log in $out" >&2
    tail -40 "$out/$target.log" >&2
    status=1
  fi
  grep -E "stat::number_of_executed_units|stat::peak_rss_mb|Done [0-9]+ runs" "$out/$target.log" || true
done
exit $status
