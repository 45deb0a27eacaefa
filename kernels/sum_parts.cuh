// The second pass of a deterministic column sum: partial sums of parts of
// the rows (a first pass's, one row of `columns` per part) summed over the
// parts, per column. A block takes 32 columns with 32 lanes of parts; each
// lane issues its loads kPartsAhead at a time before adding them in order,
// then the lanes are summed in order: the same bits every run, and a few
// hundred parts cost one or two trips to memory rather than one per part.
// Device code, included by the .cu files whose sums end this way.
#pragma once

#include <cstdint>

namespace leasehold::kernels::cuda {

inline constexpr int kPartLanes = 32;

// out_y[c] = Σ over p of partial[(y · parts + p) · columns + c], for y =
// blockIdx.y: 0 writes out0, 1 out1 (two sums of one shape in one launch);
// with add0 (add1), added to what out0 (out1) holds instead, as a
// separate addition after would round it (a gradient's sum so far).
// Launch: grid ((columns + 31) / 32, 1 or 2), 32 × kPartLanes threads.
template <class T>
__global__ void __launch_bounds__(32 * kPartLanes)
    sum_parts_kernel(T* out0, T* out1, const T* partial, int64_t columns, int64_t parts,
                     bool add0 = false, bool add1 = false) {
  constexpr int kPartsAhead = 8;
  __shared__ T lanes[kPartLanes][33];
  const int64_t c = blockIdx.x * int64_t(32) + threadIdx.x % 32;
  const int lane = threadIdx.x / 32;
  const T* src = partial + blockIdx.y * parts * columns;
  T acc = 0;
  if (c < columns) {
    for (int64_t p0 = lane; p0 < parts; p0 += int64_t(kPartLanes) * kPartsAhead) {
      T v[kPartsAhead];
#pragma unroll
      for (int u = 0; u < kPartsAhead; ++u) {
        const int64_t p = p0 + int64_t(kPartLanes) * u;
        v[u] = p < parts ? src[p * columns + c] : T(0);
      }
#pragma unroll
      for (int u = 0; u < kPartsAhead; ++u) acc += v[u];
    }
  }
  lanes[lane][threadIdx.x % 32] = acc;
  __syncthreads();
  if (lane != 0 || c >= columns) return;
  T sum = 0;
  for (int l = 0; l < kPartLanes; ++l) sum += lanes[l][threadIdx.x];
  T* out = blockIdx.y ? out1 : out0;
  out[c] = (blockIdx.y ? add1 : add0) ? out[c] + sum : sum;
}

}  // namespace leasehold::kernels::cuda
