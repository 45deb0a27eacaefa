// Mixed-precision products through cuBLASLt with their epilogues fused: a
// linear layer's bias (and ReLU or GELU) added as the product is written,
// and a weight gradient's bias gradient summed as it is computed, instead
// of a pass of their own over the [rows, features] result.
#include <cublasLt.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

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

// A product's descriptors and the algorithms considered for it (none: no
// algorithm), made once per shape, epilogue and output type on each
// thread; `chosen` indexes `candidates`.
struct Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  std::vector<cublasLtMatmulHeuristicResult_t> candidates;
  size_t chosen = 0;
  bool measured = false;
  size_t workspace_bytes = 0;  // the most any candidate needs
  // The working memory a call needs: the chosen candidate's once measured
  // (or chosen), else the most any needs (the call may measure them all).
  size_t need() const {
    return measured && !candidates.empty() ? candidates[chosen].workspaceSize : workspace_bytes;
  }
  ~Plan() {
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

using PlanKey = std::tuple<bool, bool, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int,
                           GemmOut, cublasLtHandle_t>;

std::atomic<bool> measured_choice{true};

// How an algorithm splits the reduction over k (the number of parts and
// how they are added): algorithms alike in this were seen to write the
// same bits (matmul.h), those unlike it not.
std::pair<int, int> reduction_of(const cublasLtMatmulAlgo_t& algo) {
  int parts = 1, scheme = 0;
  size_t written = 0;
  check(cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &parts,
                                             sizeof(parts), &written),
        "get SPLITK_NUM");
  check(cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME,
                                             &scheme, sizeof(scheme), &written),
        "get REDUCTION_SCHEME");
  return {parts, scheme};
}

// Row-major c [m, n] = op(a) op(b) is column-major cᵀ = op(b)ᵀ op(a)ᵀ: cuBLAS
// multiplies b by a, and a row of c is a column of its result. So a bias
// per column of c is a bias per row of cuBLAS's D (EPILOGUE_BIAS). A GELU's
// input (aux) is laid out as D, in D's type.
std::unique_ptr<Plan> make_plan(cublasLtHandle_t lt, const GemmShape& s, cublasLtEpilogue_t ep,
                                GemmOut out) {
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
  const size_t max_workspace = kLtMaxWorkspaceBytes;
  check(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                             &max_workspace, sizeof(max_workspace)),
        "set MAX_WORKSPACE_BYTES");
  cublasLtMatmulHeuristicResult_t results[kLtCandidates] = {};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(
      lt, p->desc, p->a, p->b, p->c, p->c, pref, kLtCandidates, results, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS) return p;
  for (int i = 0; i < found; ++i) {
    if (results[i].state != CUBLAS_STATUS_SUCCESS) continue;
    if (!p->candidates.empty() &&
        reduction_of(results[i].algo) != reduction_of(p->candidates.front().algo)) {
      continue;
    }
    p->candidates.push_back(results[i]);
    p->workspace_bytes = std::max(p->workspace_bytes, results[i].workspaceSize);
  }
  return p;
}

// The plan for a product on this thread, made at its first call.
Plan& plan_for(cublasLtHandle_t lt, const GemmShape& s, GemmOut out, cublasLtEpilogue_t ep) {
  thread_local std::map<PlanKey, std::unique_ptr<Plan>> plans;
  const PlanKey key{s.trans_a, s.trans_b, s.m, s.n, s.k, s.lda, s.ldb, s.ldc, int(ep), out, lt};
  auto it = plans.find(key);
  if (it == plans.end()) it = plans.emplace(key, make_plan(lt, s, ep, out)).first;
  return *it->second;
}

// One CUDA event, destroyed with it.
struct Event {
  cudaEvent_t e = nullptr;
  Event() { LEASEHOLD_CUDA_CHECK(cudaEventCreate(&e)); }
  ~Event() { (void)cudaEventDestroy(e); }  // (a destructor reports nothing)
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
};

// Times each candidate on the call's operands (a run to warm it, then
// kRuns timed by the device between two events, which the host waits for)
// and chooses the fastest. A candidate that fails to run is passed over;
// where none runs the plan is left without any (the caller takes cuBLAS).
// Each run writes c (and the GELU's input) in full with beta 0, so the
// call's own run after it writes the same.
void measure(Plan& p, cublasLtHandle_t lt, cudaStream_t stream, const bfloat16* a,
             const bfloat16* b, void* c, void* workspace, size_t workspace_bytes) {
  constexpr int kRuns = 3;
  const float one = 1.0f, zero = 0.0f;
  const auto run = [&](const cublasLtMatmulAlgo_t& algo) {
    return cublasLtMatmul(lt, p.desc, &one, b, p.a, a, p.b, &zero, c, p.c, c, p.c, &algo,
                          workspace, workspace_bytes, stream);
  };
  Event start, stop;
  float best = 0;
  bool any = false;
  for (size_t i = 0; i < p.candidates.size(); ++i) {
    const cublasLtMatmulAlgo_t& algo = p.candidates[i].algo;
    if (run(algo) != CUBLAS_STATUS_SUCCESS) continue;
    LEASEHOLD_CUDA_CHECK(cudaEventRecord(start.e, stream));
    bool ran = true;
    for (int r = 0; r < kRuns && ran; ++r) ran = run(algo) == CUBLAS_STATUS_SUCCESS;
    LEASEHOLD_CUDA_CHECK(cudaEventRecord(stop.e, stream));
    LEASEHOLD_CUDA_CHECK(cudaEventSynchronize(stop.e));
    if (!ran) continue;
    float ms = 0;
    LEASEHOLD_CUDA_CHECK(cudaEventElapsedTime(&ms, start.e, stop.e));
    if (!any || ms < best) {
      best = ms;
      p.chosen = i;
      any = true;
    }
  }
  if (!any) p.candidates.clear();
  p.measured = true;
}

bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  LEASEHOLD_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

}  // namespace

void set_gemm_measured_choice(bool on) { measured_choice = on; }

size_t gemm_bf16_fused_workspace(cublasLtHandle_t lt, const GemmShape& s, GemmOut out,
                                 const GemmEpilogue& e) {
  if (s.batch != 1 || s.m == 0 || s.n == 0 || s.k == 0) return 0;
  return plan_for(lt, s, out, epilogue_of(e)).need();
}

GemmChoice gemm_bf16_fused_choice(cublasLtHandle_t lt, const GemmShape& s, GemmOut out,
                                  const GemmEpilogue& e) {
  if (s.batch != 1 || s.m == 0 || s.n == 0 || s.k == 0) return {};
  const Plan& p = plan_for(lt, s, out, epilogue_of(e));
  return {int(p.candidates.size()), int(p.chosen), p.measured};
}

void gemm_bf16_fused_choose(cublasLtHandle_t lt, const GemmShape& s, GemmOut out,
                            const GemmEpilogue& e, int index) {
  if (s.batch != 1 || s.m == 0 || s.n == 0 || s.k == 0) {
    throw std::invalid_argument("gemm_bf16_fused_choose: no plan for an empty or batched product");
  }
  Plan& p = plan_for(lt, s, out, epilogue_of(e));
  if (index < 0 || size_t(index) >= p.candidates.size()) {
    throw std::out_of_range("gemm_bf16_fused_choose: candidate " + std::to_string(index) +
                            " of " + std::to_string(p.candidates.size()));
  }
  p.chosen = size_t(index);
  p.measured = true;
}

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
      !aligned(workspace) || (e.gelu_input && s.ldc % 8 != 0)) {
    return false;
  }
  const cublasLtEpilogue_t ep = epilogue_of(e);
  Plan& p = plan_for(lt, s, out, ep);
  if (p.candidates.empty()) return false;
  if (workspace_bytes < p.need()) {
    throw std::invalid_argument("gemm_bf16_fused: " + std::to_string(workspace_bytes) +
                                " bytes of working memory given, " + std::to_string(p.need()) +
                                " needed");
  }
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
  if (!p.measured && p.candidates.size() > 1 && measured_choice && !capturing(stream)) {
    measure(p, lt, stream, a, b, c, workspace, workspace_bytes);
    if (p.candidates.empty()) return false;
  }
  const float one = 1.0f, zero = 0.0f;
  check(cublasLtMatmul(lt, p.desc, &one, b, p.a, a, p.b, &zero, c, p.c, c, p.c,
                       &p.candidates[p.chosen].algo, workspace, workspace_bytes, stream),
        "Matmul");
  return true;
}

}  // namespace leasehold::kernels::cuda
