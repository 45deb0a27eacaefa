#!/usr/bin/env bash
# Makes a relocatable bundle for GPU hosts without package access: the
# programs, the shared libraries they need that such a host lacks (ZeroMQ,
# spdlog, fmt, ..., and the lease client libleasehold.so), and launchers in
# bin/ that set the library path. The lease client's C header goes to
# include/, for the PyTorch plug-in built on the GPU host against it.
#
#   deploy/make-bundle.sh [--with-tests] OUT_DIR [PROGRAM ...]   (after deploy/build.sh)
#
# PROGRAM ...: only these programs of build/bin (built or not by `all`),
# for a bundle that carries what one GPU check needs.
#
# Not bundled: the C runtime (glibc, libstdc++, libgcc), which the host has
# in a compatible or newer version, and the CUDA libraries, which come with
# the host's CUDA toolkit and driver (too large, and must match the driver).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=${LEASEHOLD_BUILD_DIR:-$root/build}
with_tests=0
if [ "${1:-}" = "--with-tests" ]; then with_tests=1; shift; fi
out=${1:?usage: make-bundle.sh [--with-tests] OUT_DIR [PROGRAM ...]}
shift

programs=(leasehold-coordinator leasehold-agent leasehold leasehold-bench-lease leasehold-bench-engine
  leasehold-bench-spill leasehold-bench-occupancy leasehold-bench-start leasehold-bench-share
  leasehold-bench-data-parallel leasehold-bench-fragmentation)
if [ $with_tests -eq 1 ]; then
  for t in "$build"/bin/*_test "$build"/bin/*_tests; do [ -x "$t" ] && programs+=("$(basename "$t")"); done
fi
if [ $# -gt 0 ]; then programs=("$@"); fi

rm -rf "$out"
mkdir -p "$out/bin" "$out/libexec" "$out/lib"
out=$(cd "$out" && pwd)
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libpthread|libdl\.so|librt\.so|libresolv|libstdc\+\+|libgcc_s|libcuda|libcudart|libcublas|libnvidia|libcufile|libnccl)'
for p in "${programs[@]}"; do
  [ -x "$build/bin/$p" ] || { echo "make-bundle: $build/bin/$p not built" >&2; exit 1; }
  # Debug info stays in the build tree; the bundle is for running.
  strip --strip-debug -o "$out/libexec/$p" "$build/bin/$p"
  ldd "$build/bin/$p" | awk '/=> \// {print $1, $3}' | while read -r name path; do
    [[ "$name" =~ $skip ]] && continue
    cp -nL "$path" "$out/lib/"
  done
  cat > "$out/bin/$p" <<LAUNCH
#!/usr/bin/env bash
# Launcher: bundled libraries first, then the host's CUDA libraries.
here=\$(cd "\$(dirname "\${BASH_SOURCE[0]}")/.." && pwd)
export LD_LIBRARY_PATH="\$here/lib:/usr/local/cuda/lib64\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
export LEASEHOLD_BIN_DIR="\${LEASEHOLD_BIN_DIR:-\$here/bin}"
exec "\$here/libexec/$p" "\$@"
LAUNCH
  chmod +x "$out/bin/$p"
done
# The lease client for programs built on the GPU host (the PyTorch plug-in):
# its header, the library under its SONAME (the agent's ldd above copied it
# already) and the link-time name.
lease_client=$(readlink -f "$build/lib/libleasehold.so")
[ -f "$lease_client" ] || { echo "make-bundle: $build/lib/libleasehold.so not built" >&2; exit 1; }
soname=$(readelf -d "$lease_client" | sed -n 's/.*Library soname: \[\(.*\)\]/\1/p')
mkdir -p "$out/include"
cp "$root/lease_client/leasehold.h" "$out/include/"
strip --strip-debug -o "$out/lib/$soname" "$lease_client"
ln -sf "$soname" "$out/lib/libleasehold.so"
# Program jobs: the Python package where the agent looks for it, and the
# PyTorch plug-in's sources, built on the GPU host against its own torch:
#   share/leasehold/torch_plugin/build.sh include lib lib
mkdir -p "$out/share/leasehold/python" "$out/share/leasehold/torch_plugin"
(cd "$root/python" && find . -name '*.py' -exec cp --parents {} "$out/share/leasehold/python/" \;)
cp "$root"/torch_plugin/*.h "$root"/torch_plugin/*.cpp "$root/torch_plugin/build.sh" \
  "$out/share/leasehold/torch_plugin/"
cp "$root/deploy/leasehold.toml" "$out/"
cp -r "$root/deploy/jobs" "$out/"
du -sh "$out" | awk '{print "make-bundle: " $1 " in '"$out"'"}'
