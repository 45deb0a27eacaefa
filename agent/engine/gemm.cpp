#include "agent/engine/gemm.h"

#include "agent/engine/cuda_context.h"
#include "agent/engine/kernel_table.h"

namespace leasehold::engine::detail {
namespace {

// cuBLAS takes a handle where other kernels take a stream, so each backend
// gets an adapter with the device first.
template <class T>
void gemm_cpu(Device, const kernels::GemmShape& s, T alpha, const T* a, const T* b, T beta,
              T* c) {
  kernels::cpu::gemm<T>(s, alpha, a, b, beta, c);
}

#ifdef LEASEHOLD_HAVE_CUDA
template <class T>
void gemm_cuda(Device d, const kernels::GemmShape& s, T alpha, const T* a, const T* b, T beta,
               T* c) {
  kernels::cuda::gemm<T>(cublas_handle(d.index), s, alpha, a, b, beta, c, allow_tf32());
}
#endif

template <class T>
const KernelTable<decltype(gemm_cpu<T>)> kGemm{
    "matmul", {&gemm_cpu<T>, LEASEHOLD_CUDA_KERNEL(gemm_cuda<T>)}};

}  // namespace

template <class T>
void gemm(Device d, const kernels::GemmShape& s, T alpha, const T* a, const T* b, T beta, T* c) {
  kGemm<T>(d)(d, s, alpha, a, b, beta, c);
}

template void gemm<float>(Device, const kernels::GemmShape&, float, const float*, const float*,
                          float, float*);
template void gemm<double>(Device, const kernels::GemmShape&, double, const double*,
                           const double*, double, double*);

}  // namespace leasehold::engine::detail
