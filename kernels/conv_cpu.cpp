#include "kernels/conv.h"

namespace leasehold::kernels::cpu {

// The CPU loops walk the col matrix in order with no divisions; they compute
// what detail::im2col_at / col2im_at (used by the CUDA kernels) define.
template <class T>
void im2col(Stream, T* col, const T* x, const ConvGeometry& g) {
  const int64_t oh = g.oh(), ow = g.ow();
  T* out = col;
  for (int64_t n = 0; n < g.n; ++n) {
    for (int64_t c = 0; c < g.c; ++c) {
      const T* plane = x + (n * g.c + c) * g.h * g.w;
      for (int64_t ki = 0; ki < g.kh; ++ki) {
        for (int64_t kj = 0; kj < g.kw; ++kj) {
          for (int64_t oy = 0; oy < oh; ++oy) {
            int64_t y = oy * g.stride - g.pad + ki;
            if (y < 0 || y >= g.h) {
              for (int64_t ox = 0; ox < ow; ++ox) *out++ = T(0);
              continue;
            }
            const T* row = plane + y * g.w;
            for (int64_t ox = 0; ox < ow; ++ox) {
              int64_t xx = ox * g.stride - g.pad + kj;
              *out++ = (xx >= 0 && xx < g.w) ? row[xx] : T(0);
            }
          }
        }
      }
    }
  }
}

template <class T>
void col2im(Stream, T* dx, const T* dcol, const ConvGeometry& g) {
  const int64_t oh = g.oh(), ow = g.ow();
  for (int64_t i = 0; i < g.n * g.c * g.h * g.w; ++i) dx[i] = T(0);
  const T* in = dcol;
  for (int64_t n = 0; n < g.n; ++n) {
    for (int64_t c = 0; c < g.c; ++c) {
      T* plane = dx + (n * g.c + c) * g.h * g.w;
      for (int64_t ki = 0; ki < g.kh; ++ki) {
        for (int64_t kj = 0; kj < g.kw; ++kj) {
          for (int64_t oy = 0; oy < oh; ++oy) {
            int64_t y = oy * g.stride - g.pad + ki;
            if (y < 0 || y >= g.h) {
              in += ow;
              continue;
            }
            T* row = plane + y * g.w;
            for (int64_t ox = 0; ox < ow; ++ox, ++in) {
              int64_t xx = ox * g.stride - g.pad + kj;
              if (xx >= 0 && xx < g.w) row[xx] += *in;
            }
          }
        }
      }
    }
  }
}

template <class T>
void max_pool(Stream, T* out, int64_t* argmax, const T* x, const PoolGeometry& g) {
  int64_t total = g.n * g.c * g.oh() * g.ow();
  for (int64_t i = 0; i < total; ++i) detail::max_pool_at(out, argmax, x, g, i);
}

template <class T>
void max_pool_backward(Stream, T* dx, const T* dout, const int64_t* argmax,
                       const PoolGeometry& g) {
  int64_t per_plane = g.oh() * g.ow();
  int64_t total = g.n * g.c * per_plane;
  for (int64_t i = 0; i < total; ++i) dx[(i / per_plane) * g.h * g.w + argmax[i]] += dout[i];
}

LEASEHOLD_CONV_INSTANCES_OF(float)
LEASEHOLD_CONV_INSTANCES_OF(double)

}  // namespace leasehold::kernels::cpu
