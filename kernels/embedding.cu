// CUDA embedding kernels. The gradient is summed in the sorted order of the
// indices (below), deterministic without atomics, in n × dim work for any
// vocabulary.
#include <cuda_runtime.h>

#include <cub/device/device_radix_sort.cuh>
#include <stdexcept>
#include <string>

#include "kernels/embedding.h"
#include "kernels/launch.cuh"

namespace leasehold::kernels::cuda {
namespace {

template <class T>
__global__ void embedding_forward_kernel(T* out, const T* weight, const int64_t* index,
                                         int64_t n, int64_t vocab, int64_t dim) {
  const int64_t total = n * dim;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total;
       e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t i = e / dim, c = e % dim;
    const int64_t row = index[i];
    // An index out of range (which the engine cannot check on the device
    // without waiting) reads no memory outside the table: its row is zeros.
    out[e] = row >= 0 && row < vocab ? weight[row * dim + c] : T(0);
  }
}

// The gradient is summed in the indices' sorted order: a stable radix sort
// of (index, position) pairs puts each row's positions together and in
// order; each chunk of kRunChunk sorted entries sums its runs of equal
// indices (a run's sum at the run's first entry); each row then adds its
// runs' sums in order. Work in n × dim whatever the vocabulary, and the
// same bits every run.
constexpr int kRunChunk = 32;
constexpr int kRunColumns = 128;  // threads (columns) per block

int key_bits(int64_t vocab) {  // keys are in [0, vocab]
  int bits = 1;
  while ((int64_t(1) << bits) <= vocab) ++bits;
  return bits;
}

size_t align256(size_t bytes) { return (bytes + 255) & ~size_t(255); }

size_t sort_bytes(int64_t n, int64_t vocab) {
  size_t bytes = 0;
  LEASEHOLD_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, bytes, static_cast<const int*>(nullptr), static_cast<int*>(nullptr),
      static_cast<const int*>(nullptr), static_cast<int*>(nullptr), static_cast<int>(n), 0,
      key_bits(vocab)));
  return bytes;
}

// Index i as a sort key (out of range: `vocab`, summed nowhere) and its
// position.
__global__ void embedding_keys_kernel(int* keys, int* positions, const int64_t* index, int64_t n,
                                      int64_t vocab) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t v = index[i];
    keys[i] = v >= 0 && v < vocab ? static_cast<int>(v) : static_cast<int>(vocab);
    positions[i] = static_cast<int>(i);
  }
}

template <class T>
__global__ void embedding_runs_kernel(T* partial, const T* g, const int* keys,
                                      const int* positions, int64_t n, int64_t dim) {
  const int64_t c = int64_t(blockIdx.y) * kRunColumns + threadIdx.x;
  if (c >= dim) return;
  const int64_t first = int64_t(blockIdx.x) * kRunChunk;
  const int64_t end = min(n, first + kRunChunk);
  int64_t run = first;
  int key = keys[first];
  T acc = 0;
  for (int64_t e = first; e < end; ++e) {
    const int k = keys[e];
    if (k != key) {
      partial[run * dim + c] = acc;
      acc = 0;
      run = e;
      key = k;
    }
    acc += g[int64_t(positions[e]) * dim + c];
  }
  partial[run * dim + c] = acc;
}

__device__ int64_t first_at_least(const int* keys, int64_t n, int64_t v) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = (lo + hi) / 2;
    if (keys[mid] < v) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// Row v: its entries are [s, e) of the sorted keys; their runs start at s
// and at every chunk start inside.
template <class T>
__global__ void embedding_sum_runs_kernel(T* dweight, const T* partial, const int* keys,
                                          int64_t n, int64_t dim) {
  const int64_t v = blockIdx.x;
  const int64_t c = int64_t(blockIdx.y) * kRunColumns + threadIdx.x;
  if (c >= dim) return;
  const int64_t s = first_at_least(keys, n, v), e = first_at_least(keys, n, v + 1);
  T acc = 0;
  if (s < e) {
    acc = partial[s * dim + c];
    for (int64_t r = (s / kRunChunk + 1) * kRunChunk; r < e; r += kRunChunk) {
      acc += partial[r * dim + c];
    }
  }
  dweight[v * dim + c] = acc;
}

// Where each piece of the workspace lies (each 256-byte aligned).
struct EmbeddingWork {
  int *keys_in, *keys, *positions_in, *positions;
  void* sort_temp;
  size_t sort_bytes;
  void* partial;
  size_t total;
};

EmbeddingWork carve(void* base, int64_t n, int64_t vocab, int64_t dim, size_t element_bytes) {
  EmbeddingWork w{};
  char* at = static_cast<char*>(base);
  size_t used = 0;
  auto take = [&](size_t bytes) {
    char* p = at ? at + used : nullptr;
    used += align256(bytes);
    return p;
  };
  const size_t ints = static_cast<size_t>(n) * sizeof(int);
  w.keys_in = reinterpret_cast<int*>(take(ints));
  w.keys = reinterpret_cast<int*>(take(ints));
  w.positions_in = reinterpret_cast<int*>(take(ints));
  w.positions = reinterpret_cast<int*>(take(ints));
  w.sort_bytes = sort_bytes(n, vocab);
  w.sort_temp = take(w.sort_bytes);
  w.partial = take(static_cast<size_t>(n) * static_cast<size_t>(dim) * element_bytes);
  w.total = used;
  return w;
}

}  // namespace

template <class T>
void embedding_forward(Stream s, T* out, const T* weight, const int64_t* index, int64_t n,
                       int64_t vocab, int64_t dim) {
  if (n * dim == 0) return;
  embedding_forward_kernel<T><<<grid_for(n * dim), kBlock, 0, as_cuda(s)>>>(out, weight, index,
                                                                            n, vocab, dim);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

size_t embedding_backward_workspace(int64_t n, int64_t vocab, int64_t dim, size_t element_bytes) {
  return n > 0 && vocab > 0 && dim > 0 ? carve(nullptr, n, vocab, dim, element_bytes).total : 0;
}

template <class T>
void embedding_backward(Stream s, T* dweight, const T* g, const int64_t* index, int64_t n,
                        int64_t vocab, int64_t dim, void* workspace) {
  if (vocab * dim == 0) return;
  if (vocab >= 2147483647 || n >= 2147483647) {
    throw std::invalid_argument("embedding: vocabulary or index count too large for CUDA");
  }
  const int64_t col_blocks = (dim + kRunColumns - 1) / kRunColumns;
  if (col_blocks > 65535) throw std::invalid_argument("embedding: rows too wide for CUDA");
  cudaStream_t st = as_cuda(s);
  if (n == 0) {
    LEASEHOLD_CUDA_CHECK(cudaMemsetAsync(dweight, 0, size_t(vocab * dim) * sizeof(T), st));
    return;
  }
  const EmbeddingWork w = carve(workspace, n, vocab, dim, sizeof(T));
  embedding_keys_kernel<<<grid_for(n), kBlock, 0, st>>>(w.keys_in, w.positions_in, index, n,
                                                        vocab);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
  size_t bytes = w.sort_bytes;
  LEASEHOLD_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(w.sort_temp, bytes, w.keys_in, w.keys,
                                                       w.positions_in, w.positions,
                                                       static_cast<int>(n), 0, key_bits(vocab),
                                                       st));
  T* partial = static_cast<T*>(w.partial);
  const dim3 runs(static_cast<unsigned>((n + kRunChunk - 1) / kRunChunk),
                  static_cast<unsigned>(col_blocks));
  embedding_runs_kernel<T><<<runs, kRunColumns, 0, st>>>(partial, g, w.keys, w.positions, n, dim);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
  const dim3 rows(static_cast<unsigned>(vocab), static_cast<unsigned>(col_blocks));
  embedding_sum_runs_kernel<T><<<rows, kRunColumns, 0, st>>>(dweight, partial, w.keys, n, dim);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

LEASEHOLD_EMBEDDING_INSTANCES(float)
LEASEHOLD_EMBEDDING_INSTANCES(double)

}  // namespace leasehold::kernels::cuda
