#include "agent/engine/gemm.h"

#include "agent/engine/autocast.h"
#include "agent/engine/autograd.h"
#include "agent/engine/cuda_context.h"
#include "agent/engine/dispatch.h"
#include "agent/engine/kernel_table.h"
#include "agent/engine/ops.h"
#include "kernels/elementwise.h"

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

kernels::GemmShape gemm_shape(bool ta, bool tb, int64_t m, int64_t n, int64_t k) {
  kernels::GemmShape s;
  s.trans_a = ta;
  s.trans_b = tb;
  s.m = m;
  s.n = n;
  s.k = k;
  s.lda = ta ? m : k;
  s.ldb = tb ? k : n;
  s.ldc = n;
  return s;
}

void gemm_into(Tensor& out, double beta, const Tensor& a, bool ta, const Tensor& b, bool tb,
               int64_t batch, int64_t m, int64_t n, int64_t k, bool a_batched, bool b_batched) {
  kernels::GemmShape s = gemm_shape(ta, tb, m, n, k);
  s.batch = batch;
  s.stride_a = a_batched ? m * k : 0;
  s.stride_b = b_batched ? k * n : 0;
  s.stride_c = m * n;
  detail::dispatch_floating(a.dtype(), "matmul", [&](auto tag) {
    using T = decltype(tag);
    detail::gemm<T>(a.device(), s, T(1), a.data<T>(), b.data<T>(), T(beta), out.data<T>());
  });
}

Tensor gemm(const Tensor& a, bool ta, const Tensor& b, bool tb, int64_t batch, int64_t m,
            int64_t n, int64_t k, bool a_batched, bool b_batched, Shape out_shape) {
  Tensor out = empty(out_shape, a.options());
  gemm_into(out, 0.0, a, ta, b, tb, batch, m, n, k, a_batched, b_batched);
  return out;
}

MixedProduct gemm_mixed(const Tensor& a, bool ta, [[maybe_unused]] const Tensor& b, bool tb,
                        int64_t m, int64_t n, int64_t k, Shape out_shape, DType out_dtype,
                        const MixedEpilogue& e) {
  NoGradGuard no_grad;
  [[maybe_unused]] const kernels::GemmShape s = gemm_shape(ta, tb, m, n, k);
  const auto on = [&](DType d) { return TensorOptions{d, a.device()}; };
  [[maybe_unused]] const kernels::GemmOut gemm_out =
      out_dtype == DType::BFloat16 ? kernels::GemmOut::BFloat16 : kernels::GemmOut::Float32;
  MixedProduct r;
  const bool any = e.bias.defined() || e.relu || e.gelu;
#ifdef LEASEHOLD_HAVE_CUDA
  if (!e.gelu || out_dtype == DType::BFloat16) {
    kernels::GemmEpilogue fused;
    // (The bias in the output's type, as cuBLASLt takes it: PyTorch's
    // autocast rounds it to bfloat16 too.)
    const Tensor bias = !e.bias.defined()             ? Tensor()
                        : out_dtype == DType::BFloat16 ? autocast_copy(e.bias)
                                                       : e.bias;
    fused.bias = bias.defined() ? bias.raw_data() : nullptr;
    fused.relu = e.relu;
    if (e.gelu) {
      r.gelu_input = empty(out_shape, on(DType::BFloat16));
      fused.gelu_input = r.gelu_input.data<bfloat16>();
    }
    // (cuBLASLt's working memory, from the job's leases: what the
    // product's algorithms need, often none, at most 16 MiB. It is part of
    // the step's peak where a product is.)
    const int device = a.device().index;
    const cublasLtHandle_t lt = cublaslt_handle(device);
    const size_t work_bytes = kernels::cuda::gemm_bf16_fused_workspace(lt, s, gemm_out, fused);
    // (A plain product whose algorithms need working memory, a weight
    // gradient's split over k, is left to cuBLAS, whose working memory is
    // its own, made once: through cuBLASLt it would be 5-12 MiB more at
    // each such product in backward, where a budgeted step has its peak;
    // the GPT job at 30% of its peak then needed a block's input more in
    // host memory.)
    constexpr size_t kPlainWorkspaceBytes = 64 << 10;
    if (any || work_bytes <= kPlainWorkspaceBytes) {
      r.out = empty(out_shape, on(out_dtype));
      const Tensor work =
          work_bytes == 0
              ? Tensor()
              : empty({static_cast<int64_t>((work_bytes + 7) / 8)}, on(DType::Int64));
      if (kernels::cuda::gemm_bf16_fused(lt, compute_stream(device), s, a.data<bfloat16>(),
                                         b.data<bfloat16>(), r.out.raw_data(), gemm_out, fused,
                                         work.defined() ? work.raw_data() : nullptr,
                                         work_bytes)) {
        return r;
      }
      // (Nothing was launched: what was made for it goes before the
      // fallback makes its own, so the output is not held twice.)
      r = MixedProduct{};
    }
  }
#endif
  // The product alone (in float32 when an epilogue follows), then the
  // epilogue's passes.
  Tensor out = empty(out_shape, on(any ? DType::Float32 : out_dtype));
  LEASEHOLD_CUDA_OR("linear", kernels::cuda::gemm_bf16(
                                  cublas_handle(a.device().index), s, 1.0f, a.data<bfloat16>(),
                                  b.data<bfloat16>(), 0.0f, out.raw_data(),
                                  any ? kernels::GemmOut::Float32 : gemm_out));
  if (e.bias.defined() || e.relu) {
    // (A bfloat16 result's bias rounded to bfloat16 first, as the fused
    // product takes it: the same values whichever path runs.)
    const Tensor bias = e.bias.defined() && out_dtype == DType::BFloat16
                            ? e.bias.to(DType::BFloat16).to(DType::Float32)
                            : e.bias;
    LEASEHOLD_CUDA_OR("linear", kernels::cuda::bias_activation<float>(
                                    stream_for(out.device()), out.data<float>(),
                                    bias.defined() ? bias.data<float>() : nullptr, m, n, e.relu));
  }
  if (e.gelu) {
    r.gelu_input = out.to(DType::BFloat16);
    out = gelu(out);
  }
  r.out = out.to(out_dtype);  // (itself when already of that type)
  return r;
}

void add_gemm_mixed([[maybe_unused]] Tensor& out, [[maybe_unused]] const Tensor& a, bool ta,
                    [[maybe_unused]] const Tensor& b, bool tb, int64_t m, int64_t n, int64_t k) {
  NoGradGuard no_grad;
  [[maybe_unused]] const kernels::GemmShape s = gemm_shape(ta, tb, m, n, k);
  LEASEHOLD_CUDA_OR("linear", kernels::cuda::gemm_bf16(
                                  cublas_handle(a.device().index), s, 1.0f, a.data<bfloat16>(),
                                  b.data<bfloat16>(), 1.0f, out.raw_data(),
                                  kernels::GemmOut::Float32));
}

}  // namespace leasehold::engine::detail
