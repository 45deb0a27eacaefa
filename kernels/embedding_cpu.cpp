// CPU embedding kernels: plain loops, the reference the CUDA kernels are
// tested against.
#include <algorithm>

#include "kernels/embedding.h"

namespace leasehold::kernels::cpu {

template <class T>
void embedding_forward(Stream, T* out, const T* weight, const int64_t* index, int64_t n,
                       int64_t, int64_t dim) {
  for (int64_t i = 0; i < n; ++i) std::copy_n(weight + index[i] * dim, dim, out + i * dim);
}

template <class T>
void embedding_backward(Stream, T* dweight, const T* g, const int64_t* index, int64_t n,
                        int64_t vocab, int64_t dim, void*) {
  std::fill(dweight, dweight + vocab * dim, T(0));
  for (int64_t i = 0; i < n; ++i) {
    T* row = dweight + index[i] * dim;
    for (int64_t c = 0; c < dim; ++c) row[c] += g[i * dim + c];
  }
}

LEASEHOLD_EMBEDDING_INSTANCES(float)
LEASEHOLD_EMBEDDING_INSTANCES(double)

}  // namespace leasehold::kernels::cpu
