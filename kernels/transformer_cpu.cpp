// CPU transformer kernels: plain loops, the reference the CUDA kernels are
// tested against. Attention keeps one row of scores (t values) at a time.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/transformer.h"

namespace leasehold::kernels {

namespace cpu {

template <class T>
void layer_norm_forward(Stream, T* y, T* mean, T* rstd, const T* x, const T* w, const T* b,
                        int64_t rows, int64_t cols, double eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * cols;
    T sum = 0;
    for (int64_t c = 0; c < cols; ++c) sum += xr[c];
    const T mu = sum / T(cols);
    T sq = 0;
    for (int64_t c = 0; c < cols; ++c) sq += (xr[c] - mu) * (xr[c] - mu);
    const T rs = T(1) / std::sqrt(sq / T(cols) + T(eps));
    for (int64_t c = 0; c < cols; ++c) y[r * cols + c] = (xr[c] - mu) * rs * w[c] + b[c];
    mean[r] = mu;
    rstd[r] = rs;
  }
}

template <class T>
void layer_norm_backward(Stream, T* dx, const T* dx_plus, T* dw, T* db, T*, const T* dy,
                         const T* x, const T* w, const T* mean, const T* rstd, int64_t rows,
                         int64_t cols) {
  std::fill(dw, dw + cols, T(0));
  std::fill(db, db + cols, T(0));
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * cols;
    const T* gr = dy + r * cols;
    T a = 0, bsum = 0;  // sums of dy·w and dy·w·x̂ over the row
    for (int64_t c = 0; c < cols; ++c) {
      const T xhat = (xr[c] - mean[r]) * rstd[r];
      a += gr[c] * w[c];
      bsum += gr[c] * w[c] * xhat;
      dw[c] += gr[c] * xhat;
      db[c] += gr[c];
    }
    a /= T(cols);
    bsum /= T(cols);
    for (int64_t c = 0; c < cols; ++c) {
      const T xhat = (xr[c] - mean[r]) * rstd[r];
      const T own = rstd[r] * (gr[c] * w[c] - a - xhat * bsum);
      dx[r * cols + c] = dx_plus ? own + dx_plus[r * cols + c] : own;
    }
  }
}

template <class T>
void attention_forward(Stream, T* o, T* lse, const T* q, const T* k, const T* v,
                       const AttentionLayout& at, int64_t heads, int64_t t, int64_t d,
                       double scale, bool causal) {
  const int64_t per = at.heads_per_batch;
  std::vector<T> p(static_cast<size_t>(t));
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < t; ++i) {
      const T* qi = q + at.q.at(h, i, per);
      const int64_t keys = causal ? i + 1 : t;
      T m = -std::numeric_limits<T>::infinity();
      for (int64_t j = 0; j < keys; ++j) {
        const T* kj = k + at.k.at(h, j, per);
        T s = 0;
        for (int64_t c = 0; c < d; ++c) s += qi[c] * kj[c];
        p[j] = s * T(scale);
        m = std::max(m, p[j]);
      }
      T l = 0;
      for (int64_t j = 0; j < keys; ++j) l += (p[j] = std::exp(p[j] - m));
      T* oi = o + at.o.at(h, i, per);
      std::fill(oi, oi + d, T(0));
      for (int64_t j = 0; j < keys; ++j) {
        const T* vj = v + at.v.at(h, j, per);
        for (int64_t c = 0; c < d; ++c) oi[c] += p[j] * vj[c];
      }
      for (int64_t c = 0; c < d; ++c) oi[c] /= l;
      lse[h * t + i] = m + std::log(l);
    }
  }
}

// With p_ij = exp(s_ij - lse_i): dv_j = Σ_i p_ij do_i; ds_ij = p_ij (do_i·v_j - δ_i) where
// δ_i = do_i·o_i; dq_i = scale Σ_j ds_ij k_j; dk_j = scale Σ_i ds_ij q_i.
template <class T>
void attention_backward(Stream, T* dq, T* dk, T* dv, T* workspace, const T* dout, const T* q,
                        const T* k, const T* v, const T* o, const T* lse,
                        const AttentionLayout& at, int64_t heads, int64_t t, int64_t d,
                        double scale, bool causal) {
  const int64_t per = at.heads_per_batch;
  T* delta = workspace;
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < t; ++i) {
      std::fill_n(dq + at.q.at(h, i, per), d, T(0));
      std::fill_n(dk + at.k.at(h, i, per), d, T(0));
      std::fill_n(dv + at.v.at(h, i, per), d, T(0));
      const T* doi = dout + at.o.at(h, i, per);
      const T* oi = o + at.o.at(h, i, per);
      T s = 0;
      for (int64_t c = 0; c < d; ++c) s += doi[c] * oi[c];
      delta[h * t + i] = s;
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < t; ++i) {
      const T* qi = q + at.q.at(h, i, per);
      const T* doi = dout + at.o.at(h, i, per);
      T* dqi = dq + at.q.at(h, i, per);
      const int64_t keys = causal ? i + 1 : t;
      for (int64_t j = 0; j < keys; ++j) {
        const T* kj = k + at.k.at(h, j, per);
        const T* vj = v + at.v.at(h, j, per);
        T* dkj = dk + at.k.at(h, j, per);
        T* dvj = dv + at.v.at(h, j, per);
        T s = 0, dp = 0;
        for (int64_t c = 0; c < d; ++c) {
          s += qi[c] * kj[c];
          dp += doi[c] * vj[c];
        }
        const T p = std::exp(s * T(scale) - lse[h * t + i]);
        const T ds = p * (dp - delta[h * t + i]) * T(scale);
        for (int64_t c = 0; c < d; ++c) {
          dvj[c] += p * doi[c];
          dqi[c] += ds * kj[c];
          dkj[c] += ds * qi[c];
        }
      }
    }
  }
}

LEASEHOLD_TRANSFORMER_INSTANCES(float)
LEASEHOLD_TRANSFORMER_INSTANCES(double)

}  // namespace cpu
}  // namespace leasehold::kernels
