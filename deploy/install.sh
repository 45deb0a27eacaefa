#!/bin/bash
# Installs Leasehold as a service, from a build (deploy/build.sh):
#   sudo deploy/install.sh                      # into /usr/local, enable and start
#   deploy/install.sh --root /tmp/stage --no-enable   # a staging root (packaging, CI)
#
# Puts where the units expect them: the three programs (not the benchmarks)
# in PREFIX/bin, the Python package and PyTorch plug-in sources in
# PREFIX/share/leasehold, the lease client library; the units in
# /etc/systemd/system (paths rewritten to PREFIX); the service user's
# sysusers file; /etc/leasehold/leasehold.toml (an existing configuration
# is never overwritten: the new example goes beside it as .new); the docs
# in PREFIX/share/doc/leasehold (the units' Documentation=).
#
# Standby agents: --agents N (default: one per GPU that nvidia-smi lists,
# else 1) enables leasehold-agent@0 … @N-1, one job at a time each; the
# number is written to /etc/leasehold/agents so that running this again
# keeps it. MPS: --mps on|off|auto (auto: on where nvidia-cuda-mps-control
# is installed) installs and enables leasehold-mps.service and points the
# coordinator at it (mps_directory), which systemd needs: the coordinator
# does not start its own daemon under systemd.
set -euo pipefail

src="$(cd "$(dirname "$0")/.." && pwd)"
build="${LEASEHOLD_BUILD_DIR:-$src/build}"
prefix=/usr/local
root=/
agents=""
mps=auto
enable=1

usage() {
  sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'
  echo "options: --build-dir DIR --prefix DIR --root DIR --agents N --mps on|off|auto --no-enable"
}

while [ $# -gt 0 ]; do
  case "$1" in
    --build-dir) build="$2"; shift 2 ;;
    --prefix) prefix="$2"; shift 2 ;;
    --root) root="$2"; shift 2 ;;
    --agents) agents="$2"; shift 2 ;;
    --mps) mps="$2"; shift 2 ;;
    --no-enable) enable=0; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "install.sh: unknown option '$1'" >&2; usage >&2; exit 2 ;;
  esac
done

fail() { echo "install.sh: $*" >&2; exit 1; }
[ -x "$build/bin/leasehold-coordinator" ] ||
  fail "no build in $build (run deploy/build.sh first, or name it with --build-dir)"
case "$prefix" in /*) ;; *) fail "--prefix must be an absolute path, not '$prefix'" ;; esac
case "$mps" in on|off|auto) ;; *) fail "--mps is on, off or auto, not '$mps'" ;; esac
root="${root%/}"
etc="$root/etc/leasehold"
units="$root/etc/systemd/system"

if [ -z "$agents" ] && [ -r "$etc/agents" ]; then agents="$(cat "$etc/agents")"; fi
if [ -z "$agents" ]; then
  gpus=0
  if command -v nvidia-smi >/dev/null 2>&1; then gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"; fi
  agents=$(( gpus > 0 ? gpus : 1 ))
fi
case "$agents" in ''|*[!0-9]*|0) fail "--agents must be a whole number from 1, not '$agents'" ;; esac
if [ "$mps" = auto ]; then
  if command -v nvidia-cuda-mps-control >/dev/null 2>&1 || [ -x /usr/bin/nvidia-cuda-mps-control ]; then
    mps=on
  else
    mps=off
  fi
fi

echo "installing into ${root:-/} with prefix $prefix"
# Programs, Python package, plug-in sources, lease client (CMake's rules).
DESTDIR="$root" cmake --install "$build" --prefix "$prefix" >/dev/null

# Units, with their paths where this prefix put the programs and docs.
install -d "$units"
for unit in leasehold-coordinator.service leasehold-agent@.service leasehold-mps.service; do
  sed -e "s|/usr/local/bin/|$prefix/bin/|g" -e "s|/usr/local/share/|$prefix/share/|g" \
    "$src/deploy/systemd/$unit" >"$units/$unit"
  chmod 644 "$units/$unit"
done
install -D -m644 "$src/deploy/systemd/leasehold.sysusers" "$root/usr/lib/sysusers.d/leasehold.conf"

# The configuration: an operator's file is theirs.
install -d -m755 "$etc"
config="$etc/leasehold.toml"
new="$config"
[ -e "$config" ] && new="$config.new"
cp "$src/deploy/leasehold.toml" "$new"
if [ "$mps" = on ]; then
  sed -i 's|^# mps_directory = "/run/leasehold-mps/pipe"|mps_directory = "/run/leasehold-mps/pipe"|' "$new"
fi
chmod 644 "$new"
if [ "$new" != "$config" ]; then
  echo "kept $config; the new example is $new"
  if [ "$mps" = on ] && ! grep -q '^[[:space:]]*mps_directory' "$config"; then
    echo "warning: $config sets no mps_directory: the coordinator will not use leasehold-mps;" \
      "add mps_directory = \"/run/leasehold-mps/pipe\" (see $new)" >&2
  fi
fi
echo "$agents" >"$etc/agents"

# The docs the units name.
docs="$root$prefix/share/doc/leasehold"
install -d "$docs"
install -m644 "$src/README.md" "$docs/"
if [ -d "$src/docs" ]; then cp -r "$src/docs/." "$docs/"; fi
install -d "$root$prefix/share/leasehold/jobs"
install -m644 "$src"/deploy/jobs/*.json "$root$prefix/share/leasehold/jobs/"

echo "installed: $prefix/bin/{leasehold,leasehold-coordinator,leasehold-agent}, units in /etc/systemd/system, $config, docs in $prefix/share/doc/leasehold"
echo "standby agents: $agents (one job at a time each); MPS: $mps"
if [ "$enable" = 0 ] || [ -n "$root" ]; then
  echo "not enabled (--no-enable or --root); to start:"
  echo "  systemd-sysusers && systemctl daemon-reload"
  [ "$mps" = on ] && echo "  systemctl enable --now leasehold-mps"
  echo "  systemctl enable --now leasehold-coordinator $(seq -s ' ' -f 'leasehold-agent@%g' 0 $((agents - 1)))"
  exit 0
fi
systemd-sysusers
systemctl daemon-reload
[ "$mps" = on ] && systemctl enable --now leasehold-mps
systemctl enable --now leasehold-coordinator
for i in $(seq 0 $((agents - 1))); do systemctl enable --now "leasehold-agent@$i"; done
# Agents beyond the number asked for (a smaller --agents than before) stop,
# loaded or only enabled.
for unit in $( (systemctl list-units --all --plain --no-legend 'leasehold-agent@*' | awk '{print $1}'
                ls /etc/systemd/system/*.wants/ 2>/dev/null | grep '^leasehold-agent@') | sort -u); do
  i="${unit#leasehold-agent@}"; i="${i%.service}"
  if [ "$i" -ge "$agents" ] 2>/dev/null; then systemctl disable --now "$unit"; fi
done
echo "running: systemctl status leasehold-coordinator; leasehold status"
