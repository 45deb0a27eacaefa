// The matrix product under matmul, linear and conv2d, picked from a
// KernelTable by device: OpenBLAS on the CPU, cuBLAS on a GPU (through the
// device's handle on its compute stream, TF32 as allow_tf32() says); and
// the products of tensors built on it, with autocast's mixed-precision ones
// (cuBLASLt, fused epilogues).
#pragma once

#include "agent/engine/dtype.h"
#include "agent/engine/tensor.h"
#include "kernels/matmul.h"

namespace leasehold::engine::detail {

// c = alpha · op(a) op(b) + beta · c for the operands `s` describes, all in
// memory of device `d`. T is float or double.
template <class T>
void gemm(Device d, const kernels::GemmShape& s, T alpha, const T* a, const T* b, T beta, T* c);

// Products of tensors, what matmul, linear and their backward nodes run
// (ops_matmul.cpp, ops_linear.cpp).

// One product op(A) [m, k] · op(B) [k, n] of contiguous row-major operands.
kernels::GemmShape gemm_shape(bool ta, bool tb, int64_t m, int64_t n, int64_t k);

// out = op(A) op(B) + beta · out for contiguous row-major operands, batched
// when batch > 1. A batch stride of 0 reuses one matrix across the batch.
void gemm_into(Tensor& out, double beta, const Tensor& a, bool ta, const Tensor& b, bool tb,
               int64_t batch, int64_t m, int64_t n, int64_t k, bool a_batched, bool b_batched);
// gemm_into a new tensor shaped `out_shape`, beta 0.
Tensor gemm(const Tensor& a, bool ta, const Tensor& b, bool tb, int64_t batch, int64_t m,
            int64_t n, int64_t k, bool a_batched, bool b_batched, Shape out_shape);

// What a mixed-precision product adds as it writes its result (see
// kernels::GemmEpilogue): a bias (float32 [n]), then ReLU or GELU.
struct MixedEpilogue {
  Tensor bias;
  bool relu = false;
  bool gelu = false;
};

struct MixedProduct {
  Tensor out;         // [m, n], float32 or bfloat16 as asked
  Tensor gelu_input;  // bfloat16 [m, n]: what GELU was applied to, when it was
};

// out [m, n] = op(A) op(B) for bfloat16 A and B on tensor cores (float32
// accumulation), written as `out_dtype` (float32 or bfloat16), through
// cuBLASLt with `e` fused where it has an algorithm for the product (its
// algorithm chosen by measure, matmul.h), else through cuBLAS with passes
// of its own for `e` (the same values up to rounding).
// CUDA only: autocast never runs on the CPU.
MixedProduct gemm_mixed(const Tensor& a, bool ta, const Tensor& b, bool tb, int64_t m, int64_t n,
                        int64_t k, Shape out_shape, DType out_dtype, const MixedEpilogue& e = {});
// out [m, n] += op(A) op(B), for float32 `out` and bfloat16 A and B, as
// gemm_mixed's plain product: a weight's gradient added to its sum so far
// (through cuBLAS, whose working memory is its own, with its own choice of
// algorithm: a product that makes the sum anew takes cuBLASLt's measured
// one, so the two may round differently). CUDA only.
void add_gemm_mixed(Tensor& out, const Tensor& a, bool ta, const Tensor& b, bool tb, int64_t m,
                    int64_t n, int64_t k);

}  // namespace leasehold::engine::detail
