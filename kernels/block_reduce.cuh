// Block-wide sum and max through warp shuffles and one shared-memory pass.
// Every thread of the block must call them; all threads get the result.
#pragma once

#include <math.h>

namespace leasehold::kernels {

template <class T>
__device__ inline T warp_sum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <class T>
__device__ inline T warp_max(T v) {
  for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// REQUIRES: blockDim.x is a multiple of 32 and at most 1024.
template <class T>
__device__ inline T block_sum(T v) {
  __shared__ T partial[32];
  __syncthreads();  // partial[] may still be read from a previous call
  v = warp_sum(v);
  int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  int warps = blockDim.x / 32;
  v = threadIdx.x < warps ? partial[threadIdx.x] : T(0);
  if (warp == 0) v = warp_sum(v);
  if (threadIdx.x == 0) partial[0] = v;
  __syncthreads();
  return partial[0];
}

template <class T>
__device__ inline T block_max(T v) {
  __shared__ T partial[32];
  __syncthreads();
  v = warp_max(v);
  int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  int warps = blockDim.x / 32;
  v = threadIdx.x < warps ? partial[threadIdx.x] : T(-INFINITY);
  if (warp == 0) v = warp_max(v);
  if (threadIdx.x == 0) partial[0] = v;
  __syncthreads();
  return partial[0];
}

}  // namespace leasehold::kernels
