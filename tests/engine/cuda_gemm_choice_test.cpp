// cuBLASLt's algorithms chosen by measure (kernels/matmul.h): every
// candidate a plan keeps writes the bits of the heuristic's first choice,
// for the GPT's products at its shapes, so that which one the timing picks
// (it varies with the GPU and its load) never changes a result; and a plan
// is measured at its first call outside a graph's capture. (Without CUDA
// there is nothing to test.)
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "agent/engine/cuda_context.h"
#include "agent/engine/ops.h"
#include "kernels/matmul.h"
#include "shared/device.h"

#ifdef LEASEHOLD_HAVE_CUDA
namespace leasehold::engine::testing {
namespace {

namespace kc = kernels::cuda;

class CudaGemmChoice : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device visible: test skipped";
  }
  void TearDown() override {
    if (cuda_device_count() > 0) kc::set_gemm_measured_choice(true);
  }
};

struct Product {
  std::string name;
  bool trans_a, trans_b;
  int64_t m, n, k;
  kernels::GemmOut out;
  bool bias, gelu;
};

// Runs `p` on random operands; the result (and a GELU's input) on the CPU,
// as bytes.
struct ProductRun {
  const Product& p;
  Tensor a, b, bias, c, aux, work;
  kernels::GemmShape s;
  kernels::GemmEpilogue e;

  explicit ProductRun(const Product& product) : p(product) {
    const Device cuda = Device::cuda(0);
    manual_seed(11);
    a = randn({p.trans_a ? p.k : p.m, p.trans_a ? p.m : p.k}).to(cuda).to(DType::BFloat16);
    b = mul(randn({p.trans_b ? p.n : p.k, p.trans_b ? p.k : p.n}), 0.05)
            .to(cuda)
            .to(DType::BFloat16);
    const DType out_type = p.out == kernels::GemmOut::BFloat16 ? DType::BFloat16 : DType::Float32;
    bias = randn({p.n}).to(cuda).to(out_type);
    c = empty({p.m, p.n}, {out_type, cuda});
    aux = empty({p.m, p.n}, {DType::BFloat16, cuda});
    s.trans_a = p.trans_a;
    s.trans_b = p.trans_b;
    s.m = p.m;
    s.n = p.n;
    s.k = p.k;
    s.lda = p.trans_a ? p.m : p.k;
    s.ldb = p.trans_b ? p.k : p.n;
    s.ldc = p.n;
    if (p.bias) e.bias = bias.raw_data();
    if (p.gelu) e.gelu_input = aux.data<bfloat16>();
    const size_t bytes = kc::gemm_bf16_fused_workspace(cublaslt_handle(0), s, p.out, e);
    if (bytes > 0) work = empty({int64_t((bytes + 7) / 8)}, {DType::Int64, cuda});
  }
  size_t work_bytes() const { return work.defined() ? size_t(work.numel()) * 8 : 0; }
  std::vector<char> operator()() {
    // (Every bit written again: a candidate that left any unwritten would
    // show the sentinel.)
    for (const Tensor& t : {c, aux}) {
      EXPECT_EQ(cudaMemsetAsync(t.raw_data(), 0xff, size_t(t.numel()) * dtype_size(t.dtype()),
                                compute_stream(0)),
                cudaSuccess);
    }
    EXPECT_TRUE(kc::gemm_bf16_fused(cublaslt_handle(0), compute_stream(0), s, a.data<bfloat16>(),
                                    b.data<bfloat16>(), c.raw_data(), p.out, e,
                                    work.defined() ? work.raw_data() : nullptr, work_bytes()))
        << p.name << ": cuBLASLt has no algorithm";
    std::vector<char> bytes;
    for (const Tensor& t : p.gelu ? std::vector<Tensor>{c, aux} : std::vector<Tensor>{c}) {
      const Tensor host = t.to(Device::cpu());
      const char* at = static_cast<const char*>(host.raw_data());
      bytes.insert(bytes.end(), at, at + host.numel() * dtype_size(host.dtype()));
    }
    return bytes;
  }
  kc::GemmChoice choice() const {
    return kc::gemm_bf16_fused_choice(cublaslt_handle(0), s, p.out, e);
  }
};

// The GPT job's products (64 × 256 rows, width 384): forward with a bias
// (and GELU), an input gradient in bfloat16, weight gradients in float32
// (split over k, as the heuristic takes them).
const std::vector<Product>& gpt_products() {
  using kernels::GemmOut;
  static const std::vector<Product> products = {
      {"fc1 forward with GELU", false, true, 16384, 1536, 384, GemmOut::BFloat16, true, true},
      {"qkv forward", false, true, 16384, 1152, 384, GemmOut::BFloat16, true, false},
      {"fc2 input gradient", false, false, 16384, 1536, 384, GemmOut::BFloat16, false, false},
      {"qkv weight gradient", true, false, 1152, 384, 16384, GemmOut::Float32, false, false},
      {"proj weight gradient", true, false, 384, 384, 16384, GemmOut::Float32, false, false},
  };
  return products;
}

TEST_F(CudaGemmChoice, EveryCandidateWritesTheHeuristicsFirstChoicesBits) {
  kc::set_gemm_measured_choice(false);
  for (const Product& p : gpt_products()) {
    ProductRun run(p);
    const std::vector<char> first = run();
    const kc::GemmChoice unmeasured = run.choice();
    EXPECT_FALSE(unmeasured.measured) << p.name;
    EXPECT_EQ(unmeasured.chosen, 0) << p.name;
    ASSERT_GE(unmeasured.candidates, 1) << p.name;
    EXPECT_LE(unmeasured.candidates, kc::kLtCandidates) << p.name;
    for (int i = 1; i < unmeasured.candidates; ++i) {
      kc::gemm_bf16_fused_choose(cublaslt_handle(0), run.s, p.out, run.e, i);
      EXPECT_TRUE(run() == first) << p.name << ": candidate " << i << " of "
                                  << unmeasured.candidates << " wrote other bits";
    }
    EXPECT_THROW(
        kc::gemm_bf16_fused_choose(cublaslt_handle(0), run.s, p.out, run.e, unmeasured.candidates),
        std::out_of_range);
  }
}

TEST_F(CudaGemmChoice, APlanIsMeasuredAtItsFirstCallAndKeepsItsChoice) {
  // (Shapes of their own: no other test's plan on this thread.)
  const Product p{"a forward product",        false, true, 8192, 1152, 384,
                  kernels::GemmOut::BFloat16, true,  false};
  ProductRun run(p);
  const std::vector<char> measured = run();
  const kc::GemmChoice choice = run.choice();
  ASSERT_GE(choice.candidates, 1);
  EXPECT_EQ(choice.measured, choice.candidates > 1);
  EXPECT_LT(choice.chosen, choice.candidates);
  EXPECT_TRUE(run() == measured);
  EXPECT_EQ(run.choice().chosen, choice.chosen) << "its choice kept";
  // The heuristic's first choice writes the same.
  kc::gemm_bf16_fused_choose(cublaslt_handle(0), run.s, p.out, run.e, 0);
  EXPECT_TRUE(run() == measured);
  // Too little working memory is an error, not a product.
  const size_t need = kc::gemm_bf16_fused_workspace(cublaslt_handle(0), run.s, p.out, run.e);
  if (need > 0) {
    EXPECT_THROW(kc::gemm_bf16_fused(cublaslt_handle(0), compute_stream(0), run.s,
                                     run.a.data<bfloat16>(), run.b.data<bfloat16>(),
                                     run.c.raw_data(), p.out, run.e, run.work.raw_data(), need - 1),
                 std::invalid_argument);
  }
}

// A product first met under a capture (a graph's trace or capture) runs
// the heuristic's first choice, unmeasured (nothing can be timed there);
// its next call outside measures it.
TEST_F(CudaGemmChoice, ACallUnderCaptureTakesTheFirstChoiceAndTheNextOutsideMeasures) {
  const Product p{"a product first met under capture", false, true, 4096, 1152, 384,
                  kernels::GemmOut::BFloat16,          true,  false};
  ProductRun run(p);
  cudaStream_t stream = compute_stream(0);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const bool ran =
      kc::gemm_bf16_fused(cublaslt_handle(0), stream, run.s, run.a.data<bfloat16>(),
                          run.b.data<bfloat16>(), run.c.raw_data(), p.out, run.e,
                          run.work.defined() ? run.work.raw_data() : nullptr, run.work_bytes());
  cudaGraph_t graph = nullptr;
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  EXPECT_TRUE(ran);
  EXPECT_FALSE(run.choice().measured);
  EXPECT_EQ(run.choice().chosen, 0);
  run();
  const kc::GemmChoice after = run.choice();
  EXPECT_EQ(after.measured, after.candidates > 1);
}

}  // namespace
}  // namespace leasehold::engine::testing
#endif  // LEASEHOLD_HAVE_CUDA
