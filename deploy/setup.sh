#!/usr/bin/env bash
# Installs the Debian 12 packages Leasehold needs to build and test, if any
# are missing. Idempotent; works as root or through sudo. The CUDA toolkit is
# optional and not installed here: the build uses it when it finds nvcc.
# --with-test-tools adds what only the tests use: Chromium (the dashboard
# page is checked in a real browser), Prometheus (it scrapes a running
# coordinator), clang with libFuzzer (tests/fuzz) and python3-torch (CPU:
# a real PyTorch script runs as a program job).
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config
  libzmq3-dev cppzmq-dev
  libflatbuffers-dev flatbuffers-compiler
  libboost-dev libspdlog-dev libcli11-dev libtomlplusplus-dev nlohmann-json3-dev
  libsystemd-dev libgtest-dev libopenblas-dev zlib1g-dev libsqlite3-dev
  libxxhash-dev liburing-dev fio
  libcpp-httplib-dev prometheus-cpp-dev
  libgloo-dev
  systemd
  dataset-fashion-mnist fortunes
)
if [ "${1:-}" = --with-test-tools ]; then
  packages+=(chromium fonts-dejavu-core prometheus clang-14 libclang-rt-14-dev python3-torch)
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#packages[@]} packages present"
  exit 0
fi

if [ "$(id -u)" -eq 0 ]; then
  as_root=()
elif command -v sudo >/dev/null 2>&1; then
  as_root=(sudo)
else
  echo "setup: missing packages (${missing[*]}) and neither root nor sudo is available" >&2
  exit 1
fi
echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get update -qq
"${as_root[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
