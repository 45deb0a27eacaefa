# Sourced by the GPU check scripts. Needs $out (the log folder); sets
# $failed to 1 when a step fails.
failed=0
step() {  # step NAME COMMAND...: runs, logs, records pass/fail
  local name=$1; shift
  local t0; t0=$(date +%s%N)
  "$@" > "$out/$name.log" 2>&1
  local rc=$?
  printf '%-28s rc=%d  %d ms\n' "$name" "$rc" $(( ($(date +%s%N) - t0) / 1000000 )) | tee -a "$out/summary.txt"
  [ $rc -eq 0 ] || failed=1
  grep -E '^\[  (PASSED|FAILED|SKIPPED) \]|tests? ran' "$out/$name.log" | tail -4
}
finish() {  # the verdict, and one file with every log (for transports that limit files)
  echo "overall: $([ $failed -eq 0 ] && echo PASS || echo FAIL)" | tee -a "$out/summary.txt"
  for f in "$out"/*.log; do echo "===== $(basename "$f")"; cat "$f"; done > "$out/all-logs.txt"
  exit $failed
}
