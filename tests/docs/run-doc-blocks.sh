#!/usr/bin/env bash
# Runs the fenced blocks of a Markdown file marked runnable ("```sh
# runnable"), in order, in one bash session (a coordinator one block starts
# serves the next), the way a reader would type them: from a folder where
# build/ is the build and deploy/ the repository's, with a home, runtime and
# state folder of its own (so the default endpoint and state folder are
# fresh). Every command must succeed (set -euo pipefail); background
# processes are stopped at the end. The docs cannot drift from what the
# programs do.
#
#   run-doc-blocks.sh SOURCE_DIR BUILD_DIR FILE.md
set -uo pipefail
src=$(cd "${1:?usage: run-doc-blocks.sh SOURCE_DIR BUILD_DIR FILE.md}" && pwd)
build=$(cd "${2:?build dir}" && pwd)
doc=${3:?markdown file}
case "$doc" in /*) ;; *) doc="$src/$doc" ;; esac
[ -r "$doc" ] || { echo "cannot read $doc" >&2; exit 2; }

work=$(mktemp -d /tmp/leasehold-docs-XXXXXX)
trap 'rm -rf "$work"' EXIT
ln -s "$build" "$work/build"
ln -s "$src/deploy" "$work/deploy"
ln -s "$src/docs" "$work/docs"
mkdir -p "$work/home" "$work/run" "$work/state"
chmod 700 "$work/run"

# The blocks, each announced with its line, into one script.
script="$work/blocks.sh"
awk -v file="$doc" '
  /^```sh runnable[[:space:]]*$/ { inside = 1; n++; printf "echo \"== %s:%d (block %d)\"\n", file, NR, n; next }
  /^```/ && inside { inside = 0; next }
  inside { print }
  END { if (n == 0) exit 3 }
' "$doc" >"$script.body"
case $? in
  0) ;;
  3) echo "no runnable block in $doc" >&2; exit 2 ;;
  *) echo "cannot read the blocks of $doc" >&2; exit 2 ;;
esac
{
  echo 'set -euo pipefail'
  # Whatever a block left running stops with the session, in any case.
  echo 'trap '"'"'kill $(jobs -p) 2>/dev/null || true; wait'"'"' EXIT'
  cat "$script.body"
} >"$script"

cd "$work"
env -u LEASEHOLD_ENDPOINT HOME="$work/home" XDG_RUNTIME_DIR="$work/run" \
  XDG_STATE_HOME="$work/state" timeout 300 bash "$script"
rc=$?
if [ $rc -ne 0 ]; then
  echo "FAILED: a runnable block of $doc exited $rc (the last '==' line above names it)" >&2
fi
exit $rc
