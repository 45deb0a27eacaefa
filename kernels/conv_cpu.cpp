#include "kernels/conv.h"

namespace leasehold::kernels::cpu {

template <class T>
void im2col(T* col, const T* x, const ConvGeometry& g) {
  int64_t total = g.n * g.c * g.kh * g.kw * g.oh() * g.ow();
  for (int64_t i = 0; i < total; ++i) col[i] = detail::im2col_at(x, g, i);
}

template <class T>
void col2im(T* dx, const T* dcol, const ConvGeometry& g) {
  int64_t total = g.n * g.c * g.h * g.w;
  for (int64_t i = 0; i < total; ++i) dx[i] = detail::col2im_at(dcol, g, i);
}

template <class T>
void max_pool(T* out, int64_t* argmax, const T* x, const PoolGeometry& g) {
  int64_t total = g.n * g.c * g.oh() * g.ow();
  for (int64_t i = 0; i < total; ++i) detail::max_pool_at(out, argmax, x, g, i);
}

template <class T>
void max_pool_backward(T* dx, const T* dout, const int64_t* argmax, const PoolGeometry& g) {
  int64_t per_plane = g.oh() * g.ow();
  int64_t total = g.n * g.c * per_plane;
  for (int64_t i = 0; i < total; ++i) dx[(i / per_plane) * g.h * g.w + argmax[i]] += dout[i];
}

#define LEASEHOLD_INSTANTIATE(T)                                                   \
  template void im2col<T>(T*, const T*, const ConvGeometry&);                      \
  template void col2im<T>(T*, const T*, const ConvGeometry&);                      \
  template void max_pool<T>(T*, int64_t*, const T*, const PoolGeometry&);          \
  template void max_pool_backward<T>(T*, const T*, const int64_t*, const PoolGeometry&);
LEASEHOLD_INSTANTIATE(float)
LEASEHOLD_INSTANTIATE(double)
#undef LEASEHOLD_INSTANTIATE

}  // namespace leasehold::kernels::cpu
