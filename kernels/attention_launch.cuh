// What the CUDA attention kernels share, the float32/float64 ones
// (attention.cu) and the bfloat16 tensor-core ones (attention_bf16.cu):
// the grid, the padded head sizes and backward's row dot products.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels/block_reduce.cuh"
#include "kernels/launch.cuh"
#include "kernels/transformer.h"

namespace leasehold::kernels::cuda {

// Query (or key) rows a block takes.
inline constexpr int kRowsPerBlock = 64;

// Calls f with the smallest padded head size that holds d.
template <class F>
void with_head_size(int64_t d, F&& f) {
  if (d <= 16) return f(std::integral_constant<int, 16>{});
  if (d <= 32) return f(std::integral_constant<int, 32>{});
  if (d <= 64) return f(std::integral_constant<int, 64>{});
  if (d <= kMaxCudaHeadSize) return f(std::integral_constant<int, 128>{});
  throw std::invalid_argument("attention: head size " + std::to_string(d) +
                              " is over the CUDA kernels' " + std::to_string(kMaxCudaHeadSize));
}

// Heads in x (up to 2^31 - 1 blocks), row blocks in y (up to 65535).
inline dim3 attention_grid(int64_t heads, int64_t t) {
  const int64_t row_blocks = (t + kRowsPerBlock - 1) / kRowsPerBlock;
  if (heads > 2147483647 || row_blocks > 65535) {
    throw std::invalid_argument("attention: " + std::to_string(heads) + " batch × heads of " +
                                std::to_string(t) + " tokens is over what the CUDA kernels take");
  }
  return dim3(static_cast<unsigned>(heads), static_cast<unsigned>(row_blocks));
}

namespace detail {
inline constexpr int kDeltaWarps = 8;

// delta[h t + i] = do_hi · o_hi (both laid out as at.o says), a warp per row,
// summed in Acc.
template <class T, class Acc>
__global__ void attention_delta_kernel(Acc* delta, const T* dout, const T* o, AttentionLayout at,
                                       int64_t heads, int64_t t, int64_t d) {
  const int lane = threadIdx.x % 32;
  for (int64_t r = blockIdx.x * int64_t(kDeltaWarps) + threadIdx.x / 32; r < heads * t;
       r += int64_t(gridDim.x) * kDeltaWarps) {
    const int64_t at_row = at.o.at(r / t, r % t, at.heads_per_batch);
    Acc s = 0;
    for (int64_t c = lane; c < d; c += 32) {
      s += static_cast<Acc>(dout[at_row + c]) * static_cast<Acc>(o[at_row + c]);
    }
    s = warp_sum(s);
    if (lane == 0) delta[r] = s;
  }
}
}  // namespace detail

// delta [heads, t] = the row dot products of dout and o: the softmax
// gradient's correction term, in backward's workspace (in Acc: T's own type,
// or float32 for bfloat16 activations).
template <class T, class Acc = T>
void launch_attention_delta(Acc* delta, const T* dout, const T* o, const AttentionLayout& at,
                            int64_t heads, int64_t t, int64_t d, cudaStream_t stream) {
  const int64_t rows = heads * t;
  const auto blocks = static_cast<unsigned>(
      std::clamp<int64_t>((rows + detail::kDeltaWarps - 1) / detail::kDeltaWarps, 1, 65535));
  detail::attention_delta_kernel<T, Acc><<<blocks, detail::kDeltaWarps * 32, 0, stream>>>(
      delta, dout, o, at, heads, t, d);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

}  // namespace leasehold::kernels::cuda
