#include <math.h>

#include <limits>

#include "kernels/reduce.h"

namespace leasehold::kernels::cpu {

template <class T>
void sum_rows(Stream, T* out, const T* in, int64_t outer, int64_t inner, T* /*scratch*/) {
  for (int64_t r = 0; r < outer; ++r) {
    // Accumulate in double: rows can be long (a whole tensor) and float
    // accumulation would drift from the GPU's tree order more than needed.
    double acc = 0;
    const T* row = in + r * inner;
    for (int64_t i = 0; i < inner; ++i) acc += row[i];
    out[r] = static_cast<T>(acc);
  }
}

template <class T>
void max_rows(Stream, T* values, int64_t* indices, const T* in, int64_t outer, int64_t inner) {
  for (int64_t r = 0; r < outer; ++r) {
    const T* row = in + r * inner;
    int64_t best = 0;
    for (int64_t i = 1; i < inner; ++i) {
      if (row[i] > row[best] || (isnan(row[i]) && !isnan(row[best]))) best = i;
    }
    values[r] = row[best];
    indices[r] = best;
  }
}

template <class T>
void scatter_rows(Stream, T* out, const int64_t* indices, const T* values, int64_t outer,
                  int64_t inner) {
  for (int64_t r = 0; r < outer; ++r) out[r * inner + indices[r]] += values[r];
}

template <class T>
void softmax_rows(Stream, T* out, const T* in, int64_t outer, int64_t inner, bool log) {
  for (int64_t r = 0; r < outer; ++r) {
    const T* x = in + r * inner;
    T* y = out + r * inner;
    T m = -std::numeric_limits<T>::infinity();
    for (int64_t i = 0; i < inner; ++i) m = x[i] > m ? x[i] : m;
    T s = 0;
    for (int64_t i = 0; i < inner; ++i) s += exp(x[i] - m);
    if (log) {
      T lse = m + ::log(s);
      for (int64_t i = 0; i < inner; ++i) y[i] = x[i] - lse;
    } else {
      for (int64_t i = 0; i < inner; ++i) y[i] = exp(x[i] - m) / s;
    }
  }
}

template <class T>
void softmax_backward_rows(Stream, T* gin, const T* g, const T* y, int64_t outer, int64_t inner,
                           bool log) {
  for (int64_t r = 0; r < outer; ++r) {
    const T* gr = g + r * inner;
    const T* yr = y + r * inner;
    T* out = gin + r * inner;
    T dot = 0;
    for (int64_t i = 0; i < inner; ++i) dot += log ? gr[i] : gr[i] * yr[i];
    for (int64_t i = 0; i < inner; ++i) {
      out[i] = log ? gr[i] - exp(yr[i]) * dot : yr[i] * (gr[i] - dot);
    }
  }
}

template <class T>
void cross_entropy_rows(Stream, T* loss, T* lse, const T* logits, const int64_t* labels,
                        int64_t outer, int64_t inner, int64_t* bad) {
  for (int64_t r = 0; r < outer; ++r) {
    const T* x = logits + r * inner;
    T m = -std::numeric_limits<T>::infinity();
    for (int64_t i = 0; i < inner; ++i) m = x[i] > m ? x[i] : m;
    T s = 0;
    for (int64_t i = 0; i < inner; ++i) s += exp(x[i] - m);
    lse[r] = m + ::log(s);
    int64_t y = labels[r];
    if (y < 0 || y >= inner) {
      ++bad[0];
      bad[1] = y;
      loss[r] = std::numeric_limits<T>::quiet_NaN();
    } else {
      loss[r] = lse[r] - x[y];
    }
  }
}

template <class T>
void cross_entropy_backward_rows(Stream, T* gin, const T* logits, const T* lse,
                                 const int64_t* labels, T scale, const T* grad, int64_t outer,
                                 int64_t inner) {
  scale *= *grad;
  for (int64_t r = 0; r < outer; ++r) {
    for (int64_t i = 0; i < inner; ++i) {
      T p = exp(logits[r * inner + i] - lse[r]);
      gin[r * inner + i] = (p - (i == labels[r] ? T(1) : T(0))) * scale;
    }
  }
}

LEASEHOLD_REDUCE_INSTANCES

}  // namespace leasehold::kernels::cpu
