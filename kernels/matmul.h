// Row-major GEMM: C = alpha * op(A) * op(B) + beta * C, where op(X) is X or
// its transpose. A is [m, k] after op, B [k, n], C [m, n]; lda/ldb/ldc are
// row strides. Batched: `batch` products with element strides between them
// (a stride of 0 reuses one matrix for every product).
// CPU through OpenBLAS; CUDA through cuBLAS on the given handle's stream.
#pragma once

#include <cstdint>

#include "kernels/bfloat16.h"

#ifdef LEASEHOLD_HAVE_CUDA
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#endif

namespace leasehold::kernels {

struct GemmShape {
  bool trans_a = false, trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  int64_t lda = 0, ldb = 0, ldc = 0;
  int64_t batch = 1;
  int64_t stride_a = 0, stride_b = 0, stride_c = 0;
};

// The element type a mixed-precision product writes: float32, or bfloat16
// when the result only feeds another product (it would be converted anyway).
enum class GemmOut { Float32, BFloat16 };

// What a mixed-precision product does as it writes c (cuBLASLt epilogues):
// c[i, j] += bias[j], then max(0, ·) or GELU (tanh form, with the value it
// was applied to written to gelu_input, bfloat16 like c, for backward). The
// bias has c's type (cuBLASLt's rule for bfloat16 and float32 outputs). (A
// bias's gradient is the engine's own column sum, reduce.h: cuBLASLt's
// BGRADB epilogue ran as a kernel of its own at under half the memory
// bandwidth.)
struct GemmEpilogue {
  const void* bias = nullptr;
  bool relu = false;
  bfloat16* gelu_input = nullptr;
};

namespace cpu {
template <class T>
void gemm(const GemmShape& s, T alpha, const T* a, const T* b, T beta, T* c);
}

#ifdef LEASEHOLD_HAVE_CUDA
namespace cuda {
// `tf32`: allow TF32 tensor-core math for float (off gives full FP32).
template <class T>
void gemm(cublasHandle_t handle, const GemmShape& s, T alpha, const T* a, const T* b, T beta,
          T* c, bool tf32);
// Mixed precision: bfloat16 A and B on tensor cores, float32 accumulation;
// C float32 or bfloat16 as `out` says (one product: s.batch must be 1).
void gemm_bf16(cublasHandle_t handle, const GemmShape& s, float alpha, const bfloat16* a,
               const bfloat16* b, float beta, void* c, GemmOut out);

// c = op(a) op(b) (bfloat16 in, float32 accumulation, c as `out` says) with
// `e` fused, through cuBLASLt on `stream`, with `workspace_bytes` of
// working memory at `workspace` (at least gemm_bf16_fused_workspace's; may
// be null when that is 0). False, with nothing launched, when cuBLASLt has
// no algorithm for it or a pointer is not 256-byte aligned (the caller then
// takes gemm_bf16 and passes of its own). Throws on a cuBLASLt failure or
// too little working memory.
//
// The algorithm is chosen by measure (gemm_bf16_fused_choice): of those
// cuBLASLt's heuristic offers (kLtCandidates at most), the ones that split
// the reduction as its first choice does are timed on the call's own
// operands at a plan's first call outside a CUDA graph's capture, and the
// fastest is kept for that plan. Those add each output's products over k
// as the first does: on an H200 they wrote its bits in every product of
// the GPT's, forward and backward (the GPU tests run each candidate of
// them), and those that split k otherwise did not. That they write the
// same bits is cuBLASLt's behaviour seen, not checked at each choice. The
// heuristic's first choice was 0-17% off the fastest for the GPT's
// products at their shapes (an H200: qkv with its bias 30.2 against
// 26.5 µs). A call under capture before any outside takes the heuristic's
// first. Plans are per thread, per shape, epilogue and output type.
bool gemm_bf16_fused(cublasLtHandle_t lt, cudaStream_t stream, const GemmShape& s,
                     const bfloat16* a, const bfloat16* b, void* c, GemmOut out,
                     const GemmEpilogue& e, void* workspace, size_t workspace_bytes);

// The working memory a call of the product needs: the chosen algorithm's
// once its plan was measured, before that the most any algorithm
// considered needs (0 when none does, or cuBLASLt has no algorithm for
// it); never more than kLtMaxWorkspaceBytes, in the range NVIDIA suggests
// for Hopper. Callers allocate it for each call: a product's working
// memory is part of its step's peak. Only whether e's pointers are set
// matters.
constexpr size_t kLtMaxWorkspaceBytes = size_t{16} << 20;
constexpr int kLtCandidates = 8;
size_t gemm_bf16_fused_workspace(cublasLtHandle_t lt, const GemmShape& s, GemmOut out,
                                 const GemmEpilogue& e);

// What gemm_bf16_fused chose for a product: among how many algorithms,
// which (0: the heuristic's first), and whether it was measured yet.
struct GemmChoice {
  int candidates = 0;
  int chosen = 0;
  bool measured = false;
};
GemmChoice gemm_bf16_fused_choice(cublasLtHandle_t lt, const GemmShape& s, GemmOut out,
                                  const GemmEpilogue& e);
// Makes the product's plan run candidate `index` (< its candidates) from
// now on, as if measured: for tests that run each candidate.
void gemm_bf16_fused_choose(cublasLtHandle_t lt, const GemmShape& s, GemmOut out,
                            const GemmEpilogue& e, int index);
// Off: plans not measured yet run the heuristic's first choice, unmeasured,
// until it is on again (plans measured keep theirs). Process-wide; on by
// default. For tests and benchmarks that compare the two.
void set_gemm_measured_choice(bool on);
}
#endif

}  // namespace leasehold::kernels
