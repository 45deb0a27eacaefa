// The embedding's kernels: rows of a table gathered by index, and the
// table's gradient summed back by index, deterministically (no atomics: the
// same bits every run). One signature on both backends, the stream first
// (ignored on the CPU), as in transformer.h; T is float or double.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/stream.h"

namespace leasehold::kernels {

#ifdef LEASEHOLD_HAVE_CUDA
namespace cuda {
// Bytes of working memory cuda::embedding_backward needs for n indices into
// `vocab` rows of `dim` elements of `element_bytes` (the sort of the
// indices, and a partial sum per run of equal ones).
size_t embedding_backward_workspace(int64_t n, int64_t vocab, int64_t dim, size_t element_bytes);
}  // namespace cuda
#endif

#define LEASEHOLD_EMBEDDING_KERNELS(NS)                                                          \
  namespace NS {                                                                              \
  /* out[i] = weight[index[i]] for rows of `dim`. The engine checks indices on the CPU;      \
     on CUDA an index outside [0, vocab) gives a row of zeros and reads nothing. */           \
  template <class T>                                                                          \
  void embedding_forward(Stream s, T* out, const T* weight, const int64_t* index, int64_t n,  \
                         int64_t vocab, int64_t dim);                                         \
  /* dweight [vocab, dim] = sum over i with index[i] == v of g[i], in a fixed order          \
     (deterministic, no atomics; indices out of range add nowhere). `workspace`: CUDA's      \
     cuda::embedding_backward_workspace bytes on the device (the CPU needs none). */          \
  template <class T>                                                                          \
  void embedding_backward(Stream s, T* dweight, const T* g, const int64_t* index, int64_t n,  \
                          int64_t vocab, int64_t dim, void* workspace);                       \
  }

// Explicit instantiations, expanded in embedding_cpu.cpp and embedding.cu.
#define LEASEHOLD_EMBEDDING_INSTANCES(T)                                                         \
  template void embedding_forward<T>(Stream, T*, const T*, const int64_t*, int64_t, int64_t,     \
                                     int64_t);                                                  \
  template void embedding_backward<T>(Stream, T*, const T*, const int64_t*, int64_t, int64_t,    \
                                      int64_t, void*);

LEASEHOLD_EMBEDDING_KERNELS(cpu)
#ifdef LEASEHOLD_HAVE_CUDA
LEASEHOLD_EMBEDDING_KERNELS(cuda)
#endif
#undef LEASEHOLD_EMBEDDING_KERNELS

}  // namespace leasehold::kernels
