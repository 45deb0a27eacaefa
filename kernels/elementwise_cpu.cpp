#include "kernels/elementwise.h"

#include <stdexcept>

namespace leasehold::kernels::cpu {

template <class T>
void unary(Stream, UnaryOp op, T s, T* out, const T* in, const Strided& iv, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = apply_unary<T>(op, in[iv.at(i)], s);
}

template <class T>
void binary(Stream, BinaryOp op, T s, T* out, const T* a, const Strided& av, const T* b,
            const Strided& bv, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = apply_binary<T>(op, a[av.at(i)], b[bv.at(i)], s);
}

template <class T>
void fill(Stream, T* out, T value, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = value;
}

template <class T>
void strided_copy(Stream, T* dst, const Strided& dv, const T* src, const Strided& sv, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[dv.at(i)] = src[sv.at(i)];
}

template <class T>
void dropout(Stream, T* out, const T* x, int64_t n, double p, RandomKey key, const T* residual) {
  const uint64_t seed = key.resolve(), threshold = dropout_threshold(p);
  const T scale = T(1.0 / (1.0 - p));
  for (int64_t i = 0; i < n; ++i) {
    const T kept = dropout_keeps(seed, i, threshold) ? x[i] * scale : T(0);
    out[i] = residual ? residual[i] + kept : kept;
  }
}

template <class T>
void uniform_fill(Stream, T* out, int64_t n, double low, double high, uint64_t seed) {
  const double span = high - low;
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(uniform_between(seed, i, low, span));
}

template <class To, class From>
void convert(Stream, To* out, const From* in, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<To>(in[i]);
}

void convert_bf16_copies(Stream s, const Bf16Copies& t) {
  if (t.count > kMaxConvertTensors) {
    throw std::invalid_argument("convert_bf16_copies: more than kMaxConvertTensors tensors");
  }
  for (int k = 0; k < t.count; ++k) {
    const int64_t begin = k ? t.end[k - 1] : 0;
    convert(s, t.out[k], t.in[k], t.end[k] - begin);
  }
}

LEASEHOLD_ELEMENTWISE_INSTANCES

}  // namespace leasehold::kernels::cpu
