#include "kernels/elementwise.h"

namespace leasehold::kernels::cpu {

template <class T>
void unary(UnaryOp op, T s, T* out, const T* in, const Strided& iv, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = apply_unary<T>(op, in[iv.at(i)], s);
}

template <class T>
void binary(BinaryOp op, T s, T* out, const T* a, const Strided& av, const T* b,
            const Strided& bv, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = apply_binary<T>(op, a[av.at(i)], b[bv.at(i)], s);
}

template <class T>
void fill(T* out, T value, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = value;
}

template <class T>
void strided_copy(T* dst, const Strided& dv, const T* src, const Strided& sv, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[dv.at(i)] = src[sv.at(i)];
}

template <class T>
void dropout_mask(T* out, int64_t n, double p, uint64_t seed) {
  const T keep = T(1.0 / (1.0 - p));
  for (int64_t i = 0; i < n; ++i) out[i] = uniform01(seed, i) >= p ? keep : T(0);
}

template <class T>
void uniform_fill(T* out, int64_t n, double low, double high, uint64_t seed) {
  const double span = high - low;
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>(uniform_between(seed, i, low, span));
}

template <class To, class From>
void convert(To* out, const From* in, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<To>(in[i]);
}

#define LEASEHOLD_INSTANTIATE(T)                                                         \
  template void unary<T>(UnaryOp, T, T*, const T*, const Strided&, int64_t);             \
  template void binary<T>(BinaryOp, T, T*, const T*, const Strided&, const T*,           \
                          const Strided&, int64_t);                                      \
  template void fill<T>(T*, T, int64_t);                                                 \
  template void strided_copy<T>(T*, const Strided&, const T*, const Strided&, int64_t);
LEASEHOLD_INSTANTIATE(float)
LEASEHOLD_INSTANTIATE(double)
LEASEHOLD_INSTANTIATE(int64_t)
#undef LEASEHOLD_INSTANTIATE
template void strided_copy<bfloat16>(bfloat16*, const Strided&, const bfloat16*, const Strided&,
                                     int64_t);
template void dropout_mask<float>(float*, int64_t, double, uint64_t);
template void dropout_mask<double>(double*, int64_t, double, uint64_t);
template void uniform_fill<float>(float*, int64_t, double, double, uint64_t);
template void uniform_fill<double>(double*, int64_t, double, double, uint64_t);
#define LEASEHOLD_CONVERT(To, From) template void convert<To, From>(To*, const From*, int64_t);
LEASEHOLD_CONVERT(float, bfloat16)
LEASEHOLD_CONVERT(bfloat16, float)
LEASEHOLD_CONVERT(float, double)
LEASEHOLD_CONVERT(double, float)
LEASEHOLD_CONVERT(float, int64_t)
LEASEHOLD_CONVERT(double, int64_t)
LEASEHOLD_CONVERT(int64_t, float)
LEASEHOLD_CONVERT(int64_t, double)
#undef LEASEHOLD_CONVERT

}  // namespace leasehold::kernels::cpu
