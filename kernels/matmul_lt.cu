// Mixed-precision products through cuBLASLt with their epilogues fused: a
// linear layer's bias (and ReLU or GELU) added as the product is written,
// and a weight gradient's bias gradient summed as it is computed, instead
// of a pass of their own over the [rows, features] result.
#include <cublasLt.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>

#include "kernels/matmul.h"
#include "shared/cuda_check.h"

namespace leasehold::kernels::cuda {
namespace {

void check(cublasStatus_t st, const char* what) {
  if (st != CUBLAS_STATUS_SUCCESS) {
    throw std::runtime_error(std::string("cuBLASLt ") + what + " failed: " +
                             cublasGetStatusName(st) + " (" + cublasGetStatusString(st) + ")");
  }
}

cublasLtEpilogue_t epilogue_of(const GemmEpilogue& e) {
  if (e.gelu_input) return e.bias ? CUBLASLT_EPILOGUE_GELU_AUX_BIAS : CUBLASLT_EPILOGUE_GELU_AUX;
  if (e.bias) return e.relu ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_BIAS;
  return e.relu ? CUBLASLT_EPILOGUE_RELU : CUBLASLT_EPILOGUE_DEFAULT;
}

bool has_bias(cublasLtEpilogue_t ep) {
  return ep == CUBLASLT_EPILOGUE_BIAS || ep == CUBLASLT_EPILOGUE_RELU_BIAS ||
         ep == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
}

bool has_aux(cublasLtEpilogue_t ep) {
  return ep == CUBLASLT_EPILOGUE_GELU_AUX || ep == CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
}

// A product's descriptors and the algorithm the heuristic chose for it, or
// none (`found` false): made once per shape and epilogue on each thread.
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool found = false;
  ~Plan() {
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

using PlanKey = std::tuple<bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int,
                           GemmOut, size_t, cublasLtHandle_t>;

// Row-major c [m, n] = op(a) op(b) is column-major cᵀ = op(b)ᵀ op(a)ᵀ: cuBLAS
// multiplies b by a, and a row of c is a column of its result. So a bias
// per column of c is a bias per row of cuBLAS's D (EPILOGUE_BIAS). A GELU's
// input (aux) is laid out as D, in D's type.
std::unique_ptr<Plan> make_plan(cublasLtHandle_t lt, const GemmShape& s, cublasLtEpilogue_t ep,
                                GemmOut out, size_t workspace_bytes) {
  const cudaDataType_t c_type = out == GemmOut::BFloat16 ? CUDA_R_16BF : CUDA_R_32F;
  auto p = std::make_unique<Plan>();
  check(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "MatmulDescCreate");
  const cublasOperation_t opa = s.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;  // cuBLAS's A is b
  const cublasOperation_t opb = s.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  check(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa)),
        "set TRANSA");
  check(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb)),
        "set TRANSB");
  check(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &ep, sizeof(ep)),
        "set EPILOGUE");
  if (has_bias(ep)) {
    check(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &c_type,
                                         sizeof(c_type)),
          "set BIAS_DATA_TYPE");
  }
  if (has_aux(ep)) {
    const int64_t aux_ld = s.ldc;
    check(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld,
                                         sizeof(aux_ld)),
          "set EPILOGUE_AUX_LD");
    check(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE,
                                         &c_type, sizeof(c_type)),
          "set EPILOGUE_AUX_DATA_TYPE");
  }
  // cuBLAS's A = op(b): stored [k, n] row-major (or [n, k] when trans_b),
  // which column-major reads as [n, k] (or [k, n]).
  const uint64_t a_rows = s.trans_b ? s.k : s.n, a_cols = s.trans_b ? s.n : s.k;
  const uint64_t b_rows = s.trans_a ? s.m : s.k, b_cols = s.trans_a ? s.k : s.m;
  check(cublasLtMatrixLayoutCreate(&p->a, CUDA_R_16BF, a_rows, a_cols, s.ldb), "layout A");
  check(cublasLtMatrixLayoutCreate(&p->b, CUDA_R_16BF, b_rows, b_cols, s.lda), "layout B");
  check(cublasLtMatrixLayoutCreate(&p->c, c_type, s.n, s.m, s.ldc), "layout C");
  cublasLtMatmulPreference_t pref = nullptr;
  check(cublasLtMatmulPreferenceCreate(&pref), "PreferenceCreate");
  check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                             &workspace_bytes, sizeof(workspace_bytes)),
        "set MAX_WORKSPACE_BYTES");
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(lt, p->desc, p->a, p->b, p->c, p->c,
                                                           pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st == CUBLAS_STATUS_SUCCESS && found > 0) {
    p->algo = result.algo;
    p->found = true;
  }
  return p;
}

}  // namespace

bool gemm_bf16_fused(cublasLtHandle_t lt, cudaStream_t stream, const GemmShape& s,
                     const bfloat16* a, const bfloat16* b, void* c, GemmOut out,
                     const GemmEpilogue& e, void* workspace, size_t workspace_bytes) {
  if (s.batch != 1) throw std::invalid_argument("gemm_bf16_fused: one product at a time");
  if (e.relu && e.gelu_input) {
    throw std::invalid_argument("gemm_bf16_fused: ReLU or GELU, not both");
  }
  if (e.gelu_input && out != GemmOut::BFloat16) {
    throw std::invalid_argument("gemm_bf16_fused: GELU writes a bfloat16 result and input");
  }
  if (s.m == 0 || s.n == 0 || s.k == 0) return false;
  // The heuristic assumes its default alignment of every pointer (256
  // bytes), and a GELU input's leading dimension must be a multiple of 8:
  // anything else (a view at an offset) is left to the caller's passes
  // rather than failing in the product.
  const auto aligned = [](const void* p) {
    return p == nullptr || reinterpret_cast<uintptr_t>(p) % 256 == 0;
  };
  if (!aligned(a) || !aligned(b) || !aligned(c) || !aligned(e.bias) || !aligned(e.gelu_input) ||
      (e.gelu_input && s.ldc % 8 != 0)) {
    return false;
  }
  const cublasLtEpilogue_t ep = epilogue_of(e);
  thread_local std::map<PlanKey, std::unique_ptr<Plan>> plans;
  const PlanKey key{s.trans_a, s.trans_b, s.m, s.n, s.k, s.lda, s.ldb, s.ldc, int(ep),
                    out, workspace_bytes, lt};
  auto it = plans.find(key);
  if (it == plans.end()) it = plans.emplace(key, make_plan(lt, s, ep, out, workspace_bytes)).first;
  Plan& p = *it->second;
  if (!p.found) return false;
  if (has_bias(ep)) {
    const void* ptr = e.bias;
    check(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &ptr,
                                         sizeof(ptr)),
          "set BIAS_POINTER");
  }
  if (has_aux(ep)) {
    void* aux = e.gelu_input;
    check(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux,
                                         sizeof(aux)),
          "set EPILOGUE_AUX_POINTER");
  }
  const float one = 1.0f, zero = 0.0f;
  check(cublasLtMatmul(lt, p.desc, &one, b, p.a, a, p.b, &zero, c, p.c, c, p.c, &p.algo,
                       workspace, workspace_bytes, stream),
        "Matmul");
  return true;
}

}  // namespace leasehold::kernels::cuda
