#!/usr/bin/env bash
# Builds libleasehold_torch.so, the PyTorch plug-in (docs/torch-plugin.md),
# against the torch of `/usr/bin/env python3`: the torch that will load it.
#
#   torch_plugin/build.sh LEASE_CLIENT_INCLUDE_DIR LEASE_CLIENT_LIB_DIR OUT_DIR
#
# LEASE_CLIENT_INCLUDE_DIR holds leasehold.h (lease_client/ of the sources or
# an installation's include/), LEASE_CLIENT_LIB_DIR libleasehold.so (a build
# tree's lib/ or an installation's lib/); OUT_DIR receives
# libleasehold_torch.so. The CUDA toolkit is $CUDA_HOME, else /usr/local/cuda;
# its major version must be torch's (one CUDA runtime in the process).
#
# Needs: g++, a torch built with CUDA (its headers and libc10), the CUDA
# runtime's headers and library, libleasehold.so.
set -euo pipefail

die() {
  echo "build.sh: $*" >&2
  exit 1
}

[[ $# -eq 3 ]] || die "usage: $0 LEASE_CLIENT_INCLUDE_DIR LEASE_CLIENT_LIB_DIR OUT_DIR"
[[ -f "$1/leasehold.h" ]] || die "no leasehold.h in $1"
lease_inc=$(cd "$1" && pwd)
[[ -d "$2" ]] || die "no folder $2"
lease_lib=$(cd "$2" && pwd)
compgen -G "$lease_lib/libleasehold.so*" > /dev/null || die "no libleasehold.so in $lease_lib"
mkdir -p "$3"
out=$(cd "$3" && pwd)
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(dirname "$here")
command -v g++ > /dev/null || die "g++ not found"

# What torch says of itself: OK, its version, its CUDA version, its C++ ABI
# flag, its lib folder, then its include folders, one per line.
torch_info=$(/usr/bin/env python3 - <<'PY'
import os, sys
try:
    import torch
    from torch.utils import cpp_extension
except Exception as e:  # no torch, or a broken one
    print("ERROR cannot import torch with %s: %s" % (sys.executable, e))
    sys.exit(0)
if not torch.version.cuda:
    print("ERROR torch %s of %s is built without CUDA: the plug-in is a CUDA allocator "
          "(install a CUDA build of torch)" % (torch.__version__, sys.executable))
    sys.exit(0)
print("OK")
print(torch.__version__)
print(torch.version.cuda)
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))
print(os.path.join(os.path.dirname(torch.__file__), "lib"))
for p in cpp_extension.include_paths():
    print(p)
PY
) || die "/usr/bin/env python3 failed"
mapfile -t info <<< "$torch_info"
[[ "${info[0]:-}" == OK ]] || die "${info[0]#ERROR }"
torch_version=${info[1]}
torch_cuda=${info[2]}
torch_abi=${info[3]}
torch_lib=${info[4]}
torch_includes=("${info[@]:5}")
[[ -f "$torch_lib/libc10.so" ]] || die "no libc10.so in $torch_lib (torch $torch_version)"
include_flags=()
for d in "${torch_includes[@]}"; do
  [[ -n "$d" ]] && include_flags+=("-I$d")
done

cuda_home=${CUDA_HOME:-/usr/local/cuda}
[[ -f "$cuda_home/include/cuda_runtime_api.h" ]] ||
  die "no CUDA toolkit at $cuda_home (set CUDA_HOME): cuda_runtime_api.h not found"
cuda_lib=$cuda_home/lib64
[[ -d "$cuda_lib" ]] || cuda_lib=$cuda_home/lib
compgen -G "$cuda_lib/libcudart.so*" > /dev/null || die "no libcudart.so in $cuda_lib"
cudart_version=$(sed -n 's/^#define CUDART_VERSION *\([0-9]*\).*/\1/p' \
  "$cuda_home/include/cuda_runtime_api.h" | head -n 1)
[[ -n "$cudart_version" ]] || die "cannot read CUDART_VERSION from $cuda_home/include"
# Two CUDA runtimes of different majors in one process keep two current
# devices: build with the major torch was built with.
if [[ $((cudart_version / 1000)) != "${torch_cuda%%.*}" ]]; then
  die "the CUDA toolkit at $cuda_home is $((cudart_version / 1000)).x, torch $torch_version" \
    "uses CUDA $torch_cuda: set CUDA_HOME to a CUDA ${torch_cuda%%.*} toolkit"
fi

# The plug-in's sources, then the session leases' and the block cache's
# (CMakeLists.txt lists the same files: the leasehold_torch target,
# LEASEHOLD_SESSION_LEASES_SOURCES and LEASEHOLD_BLOCK_CACHE_SOURCES).
sources=(
  leasehold_torch.cpp plugin_state.cpp shrink_worker.cpp cuda_streams.cpp standby_arena.cpp
  session_leases.cpp messages.cpp
  block_cache.cpp block_cache_check.cpp block_pool.cpp stream_order.cpp graph_holds.cpp growth_rule.cpp
  segment_leases.cpp
)
source_paths=("${sources[@]/#/$here/}")

echo "build.sh: torch $torch_version (CUDA $torch_cuda, C++11 ABI $torch_abi), CUDA at $cuda_home"
g++ -std=c++20 -O2 -g -fPIC -shared -Wall -Wextra \
  -fvisibility=hidden -fvisibility-inlines-hidden \
  -D_GLIBCXX_USE_CXX11_ABI="$torch_abi" \
  -I"$root" -I"$lease_inc" -I"$cuda_home/include" "${include_flags[@]}" \
  "${source_paths[@]}" \
  -o "$out/libleasehold_torch.so" \
  -L"$torch_lib" -L"$lease_lib" -L"$cuda_lib" \
  -lc10 -lleasehold -lcudart -pthread \
  -Wl,--no-undefined \
  -Wl,-rpath,"$torch_lib" -Wl,-rpath,"$lease_lib" -Wl,-rpath,"$cuda_lib"

if command -v nm > /dev/null; then
  exports=$(nm -D --defined-only "$out/libleasehold_torch.so" | awk '{print $3}' | grep '^leasehold_torch_' | sort | tr '\n' ' ')
  echo "build.sh: $out/libleasehold_torch.so exports: $exports"
  [[ "$exports" == *leasehold_torch_alloc* && "$exports" == *leasehold_torch_free* ]] ||
    die "the plug-in does not export its functions"
fi
