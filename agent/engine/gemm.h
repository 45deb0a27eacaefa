// The matrix product under matmul, linear and conv2d, picked from a
// KernelTable by device: OpenBLAS on the CPU, cuBLAS on a GPU (through the
// device's handle on its compute stream, TF32 as allow_tf32() says).
#pragma once

#include "agent/engine/dtype.h"
#include "kernels/matmul.h"

namespace leasehold::engine::detail {

// c = alpha · op(a) op(b) + beta · c for the operands `s` describes, all in
// memory of device `d`. T is float or double.
template <class T>
void gemm(Device d, const kernels::GemmShape& s, T alpha, const T* a, const T* b, T beta, T* c);

}  // namespace leasehold::engine::detail
