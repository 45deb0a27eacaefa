#include <cstdint>

#include "kernels/gather.h"
#include "kernels/launch.cuh"

namespace leasehold::kernels::cuda {
namespace {

// One grid-stride loop over the words of the output; W is the word moved
// per thread (uint4 for 16-byte aligned rows, else a byte).
template <class W>
__global__ void take_rows_kernel(W* out, const W* src, const int64_t* index, int64_t count,
                                 int64_t row_words) {
  const int64_t total = count * row_words;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / row_words, col = i - row * row_words;
    out[i] = src[index[row] * row_words + col];
  }
}

template <class W>
void launch(void* out, const void* src, const int64_t* index, int64_t count, int64_t row_words,
            cudaStream_t stream) {
  take_rows_kernel<W><<<grid_for(count * row_words), kBlock, 0, stream>>>(
      static_cast<W*>(out), static_cast<const W*>(src), index, count, row_words);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

// One thread per output token (each reads one byte: the windows of a
// batch overlap nothing and are read once).
__global__ void take_byte_windows_kernel(int64_t* out, const uint8_t* bytes, const int64_t* index,
                                         int64_t count, int64_t width, int64_t stride,
                                         int64_t offset) {
  const int64_t total = count * width;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / width, t = i - row * width;
    out[i] = bytes[index[row] * stride + offset + t];
  }
}

}  // namespace

void take_byte_windows(Stream queue, int64_t* out, const uint8_t* bytes, const int64_t* index,
                       int64_t count, int64_t width, int64_t stride, int64_t offset) {
  if (count == 0 || width == 0) return;
  take_byte_windows_kernel<<<grid_for(count * width), kBlock, 0, as_cuda(queue)>>>(
      out, bytes, index, count, width, stride, offset);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

void take_rows(Stream queue, void* out, const void* src, const int64_t* index, int64_t count,
               int64_t row_bytes) {
  cudaStream_t stream = as_cuda(queue);
  if (count == 0 || row_bytes == 0) return;
  const bool wide = row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(out) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(src) % 16 == 0;
  if (wide) {
    launch<uint4>(out, src, index, count, row_bytes / 16, stream);
  } else if (row_bytes % 4 == 0 && reinterpret_cast<uintptr_t>(out) % 4 == 0 &&
             reinterpret_cast<uintptr_t>(src) % 4 == 0) {
    launch<uint32_t>(out, src, index, count, row_bytes / 4, stream);
  } else {
    launch<uint8_t>(out, src, index, count, row_bytes, stream);
  }
}

}  // namespace leasehold::kernels::cuda
