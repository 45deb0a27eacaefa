// Every operator on CUDA against the CPU reference, forward and backward, on
// awkward shapes (1, 3, 7, 33, 1000, 1025, 2^20 + 3) and non-contiguous
// views. Skipped without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>

#include "agent/engine/autograd.h"
#include "agent/engine/cuda_context.h"
#include "agent/engine/data.h"
#include "agent/engine/nn.h"
#include "agent/engine/ops.h"
#include "agent/engine/optim.h"
#include "kernels/conv.h"
#include "shared/device.h"
#include "tests/engine/fused_check.h"
#include "tests/engine/gradcheck.h"
#include "tests/engine/op_registry.h"

namespace leasehold::engine::testing {
namespace {

enum class Input { Any, Positive, AwayFromZero };

struct Case {
  std::string name;
  std::vector<Shape> shapes;
  Fn f;
  double tol = 1e-4;
  Input input = Input::Any;
  DType dtype = DType::Float32;
};

Tensor make_input(const Shape& s, Input kind) {
  switch (kind) {
    case Input::Positive: return rand(s, {}, 0.5, 2.0);
    case Input::AwayFromZero: {
      auto v = rand(s, {}, 0.2, 1.5).to_vector<float>();
      auto sign = rand(s, {}, -1, 1).to_vector<float>();
      for (size_t i = 0; i < v.size(); ++i) v[i] = sign[i] < 0 ? -v[i] : v[i];
      return from_vector(v, s);
    }
    default: return randn(s);
  }
}

class CudaOps : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device visible: test skipped";
  }
  void check(const Case& c) {
    SCOPED_TRACE(c.name);
    std::vector<Tensor> cpu, gpu;
    for (const auto& s : c.shapes) {
      Tensor x = make_input(s, c.input).to(c.dtype);
      cpu.push_back(x.clone().set_requires_grad(true));
      gpu.push_back(x.to(Device::cuda()).set_requires_grad(true));
    }
    Tensor out_c = c.f(cpu), out_g = c.f(gpu);
    ASSERT_EQ(out_g.device(), Device::cuda());
    ASSERT_EQ(out_c.sizes(), out_g.sizes());
    EXPECT_LE(max_rel_diff(out_g, out_c), c.tol) << "forward";
    if (!out_c.requires_grad()) return;
    Tensor r = randn(out_c.sizes()).to(out_c.dtype());
    sum(mul(out_c, r)).backward();
    sum(mul(out_g, r.to(Device::cuda()))).backward();
    for (size_t i = 0; i < cpu.size(); ++i) {
      if (!cpu[i].grad().defined()) continue;
      ASSERT_TRUE(gpu[i].grad().defined()) << "input " << i;
      EXPECT_LE(max_rel_diff(gpu[i].grad(), cpu[i].grad()), c.tol) << "gradient of input " << i;
    }
  }
};

// Every operator of the shared list (op_registry.h), float32, CUDA against
// the CPU, forward and every input's gradient.
TEST_F(CudaOps, RegisteredOperatorsMatchTheCpu) {
  for (const OpCase& c : op_cases()) {
    SCOPED_TRACE(c.name);
    manual_seed(31);
    std::vector<Tensor> cpu, gpu;
    for (const Tensor& x : c.inputs()) {
      Tensor x32 = x.to(DType::Float32);
      cpu.push_back(x32.clone().set_requires_grad(true));
      gpu.push_back(x32.to(Device::cuda()).set_requires_grad(true));
    }
    Tensor out_c = c.fn(cpu), out_g = c.fn(gpu);
    ASSERT_EQ(out_g.device(), Device::cuda());
    ASSERT_EQ(out_c.sizes(), out_g.sizes());
    EXPECT_LE(max_rel_diff(out_g, out_c), c.cuda_tolerance) << "forward";
    Tensor r = randn(out_c.sizes());
    sum(mul(out_c, r)).backward();
    sum(mul(out_g, r.to(Device::cuda()))).backward();
    for (size_t i = 0; i < cpu.size(); ++i) {
      ASSERT_TRUE(cpu[i].grad().defined() && gpu[i].grad().defined()) << "input " << i;
      EXPECT_LE(max_rel_diff(gpu[i].grad(), cpu[i].grad()), c.cuda_tolerance)
          << "gradient of input " << i;
    }
  }
}

// The layer norm's and the embedding's gradients are summed in a fixed order
// on the device: two runs give the same bits.
TEST_F(CudaOps, TransformerGradientsAreDeterministic) {
  manual_seed(32);
  Tensor x = randn({1000, 96}).to(Device::cuda());
  Tensor w = randn({96}).to(Device::cuda()).set_requires_grad(true);
  Tensor b = randn({96}).to(Device::cuda()).set_requires_grad(true);
  Tensor table = randn({256, 96}).to(Device::cuda()).set_requires_grad(true);
  std::vector<int64_t> tokens(5000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int64_t>((i * 31) % 7);
  Tensor index = from_vector(tokens, {50, 100}, Device::cuda());
  std::vector<std::vector<float>> first;
  for (int run = 0; run < 2; ++run) {
    w.set_grad(Tensor());
    b.set_grad(Tensor());
    table.set_grad(Tensor());
    sum(layer_norm(x, w, b)).backward();
    sum(mul(embedding(table, index), 1.5)).backward();
    std::vector<std::vector<float>> got = {w.grad().to_vector<float>(),
                                           b.grad().to_vector<float>(),
                                           table.grad().to_vector<float>()};
    if (run == 0) {
      first = got;
    } else {
      EXPECT_EQ(got, first);
    }
  }
}

TEST_F(CudaOps, AttentionRejectsHeadSizesOverTheKernels) {
  Tensor q = zeros({1, 1, 4, 129}, TensorOptions{}.on(Device::cuda()));
  EXPECT_THROW(scaled_dot_product_attention(q, q, q, true), std::invalid_argument);
}

TEST_F(CudaOps, ClipGradNormAndAdamWMatchTheCpu) {
  manual_seed(33);
  Tensor w0 = randn({33, 7}), b0 = randn({7});
  Tensor wc = w0.clone().set_requires_grad(true), bc = b0.clone().set_requires_grad(true);
  Tensor wg = w0.to(Device::cuda()).set_requires_grad(true);
  Tensor bg = b0.to(Device::cuda()).set_requires_grad(true);
  optim::AdamOptions o{.lr = 0.01, .weight_decay = 0.1, .decoupled = true,
                       .decay_matrices_only = true};
  optim::Adam cpu_opt({{"w", wc}, {"b", bc}}, o), gpu_opt({{"w", wg}, {"b", bg}}, o);
  for (int step = 0; step < 3; ++step) {
    for (auto* opt : {&cpu_opt, &gpu_opt}) opt->zero_grad();
    sum(mul(add(wc, bc), 3.0)).backward();
    sum(mul(add(wg, bg), 3.0)).backward();
    Tensor nc = optim::clip_grad_norm({{"w", wc}, {"b", bc}}, 1.0);
    Tensor ng = optim::clip_grad_norm({{"w", wg}, {"b", bg}}, 1.0);
    EXPECT_NEAR(ng.item(), nc.item(), 1e-3);
    cpu_opt.step();
    gpu_opt.step();
  }
  EXPECT_LE(max_rel_diff(wg, wc), 1e-5);
  EXPECT_LE(max_rel_diff(bg, bc), 1e-5);
}

TEST_F(CudaOps, Elementwise) {
  manual_seed(1);
  for (const Shape& s : {Shape{1}, Shape{7}, Shape{1025}, Shape{33, 33}}) {
    check({"neg", {s}, [](auto& v) { return neg(v[0]); }});
    check({"exp", {s}, [](auto& v) { return exp(v[0]); }});
    check({"log", {s}, [](auto& v) { return log(v[0]); }, 1e-4, Input::Positive});
    check({"pow", {s}, [](auto& v) { return pow(v[0], 3.0); }});
    check({"sqrt", {s}, [](auto& v) { return sqrt(v[0]); }, 1e-4, Input::Positive});
    check({"abs", {s}, [](auto& v) { return abs(v[0]); }, 1e-4, Input::AwayFromZero});
    check({"relu", {s}, [](auto& v) { return relu(v[0]); }, 1e-4, Input::AwayFromZero});
    check({"sigmoid", {s}, [](auto& v) { return sigmoid(v[0]); }});
    check({"tanh", {s}, [](auto& v) { return tanh(v[0]); }});
    check({"scalar", {s}, [](auto& v) { return add(mul(v[0], 1.5), 2.0); }});
  }
  check({"add broadcast", {{33, 1}, {1, 7}}, [](auto& v) { return add(v[0], v[1]); }});
  check({"sub broadcast", {{3, 1000}, {1000}}, [](auto& v) { return sub(v[0], v[1]); }});
  check({"mul", {{1025}, {1025}}, [](auto& v) { return mul(v[0], v[1]); }});
  check({"div", {{7, 33}, {33}}, [](auto& v) { return div(v[0], v[1]); }, 1e-4,
         Input::AwayFromZero});
  check({"transposed", {{33, 7}, {7, 33}},
         [](auto& v) { return mul(relu(v[0].transpose(0, 1)), v[1]); }});
  check({"narrowed", {{7, 1025}}, [](auto& v) { return tanh(v[0].narrow(1, 3, 1000)); }});
}

TEST_F(CudaOps, Matmul) {
  manual_seed(2);
  check({"1x1", {{1, 1}, {1, 1}}, [](auto& v) { return matmul(v[0], v[1]); }});
  check({"7x33x3", {{7, 33}, {33, 3}}, [](auto& v) { return matmul(v[0], v[1]); }});
  check({"33x1025x7", {{33, 1025}, {1025, 7}}, [](auto& v) { return matmul(v[0], v[1]); }, 1e-3});
  check({"batched", {{3, 7, 33}, {3, 33, 5}}, [](auto& v) { return matmul(v[0], v[1]); }});
  check({"batched x shared", {{3, 7, 33}, {33, 5}}, [](auto& v) { return matmul(v[0], v[1]); }});
  check({"transposed", {{33, 7}, {33, 5}},
         [](auto& v) { return matmul(v[0].transpose(0, 1), v[1]); }});
  check({"linear", {{128, 400}, {120, 400}, {120}},
         [](auto& v) { return linear(v[0], v[1], v[2]); }, 1e-3});
  check({"linear without bias", {{7, 33}, {5, 33}},
         [](auto& v) { return linear(v[0], v[1], Tensor()); }});
  // The ReLU fused in (bias and ReLU after the GEMM, mask and bias gradient
  // in one pass), and past kMaxColumnRows rows as two operations.
  check({"linear relu", {{128, 400}, {120, 400}, {120}},
         [](auto& v) { return linear(v[0], v[1], v[2], true); }, 1e-3});
  check({"linear relu without bias", {{9, 33}, {5, 33}},
         [](auto& v) { return linear(v[0], v[1], Tensor(), true); }});
  check({"linear relu, many rows", {{5000, 3}, {4, 3}, {4}},
         [](auto& v) { return linear(v[0], v[1], v[2], true); }, 1e-3});
  check({"linear relu double", {{9, 33}, {5, 33}, {5}},
         [](auto& v) { return linear(v[0], v[1], v[2], true); }, 1e-9, Input::Any,
         DType::Float64});
  // The small-product kernel with both operands transposed.
  check({"small, both transposed", {{33, 7}, {5, 33}},
         [](auto& v) { return matmul(v[0].transpose(0, 1), v[1].transpose(0, 1)); }});
}

// The contiguous fast paths (16-byte words, a tail after them) and the
// strided ones they fall back to (a view one element off alignment), and
// the row sums' warp-per-row, word and two-pass paths, against the CPU.
TEST_F(CudaOps, ContiguousFastPathsMatchTheCpu) {
  manual_seed(12);
  for (int64_t n : {int64_t{3}, int64_t{4}, int64_t{1025}, int64_t{4099}, int64_t{1} << 20}) {
    const std::string at = std::to_string(n);
    check({"add " + at, {{n}, {n}}, [](auto& v) { return add(v[0], v[1]); }});
    check({"mul " + at, {{n}, {n}}, [](auto& v) { return mul(v[0], v[1]); }});
    check({"relu " + at, {{n}}, [](auto& v) { return relu(v[0]); }});
    check({"exp of a misaligned view " + at, {{n + 1}},
           [n](auto& v) { return exp(v[0].narrow(0, 1, n)); }});
    check({"add misaligned " + at, {{n + 1}, {n}},
           [n](auto& v) { return add(v[0].narrow(0, 1, n), v[1]); }});
  }
  for (int64_t inner : {int64_t{1}, int64_t{31}, int64_t{1000}, int64_t{1001}, int64_t{2048},
                        int64_t{2049}, int64_t{4096}, int64_t{70000}}) {
    const std::string at = std::to_string(inner);
    check({"row sums of " + at, {{37, inner}}, [](auto& v) { return sum(v[0], {1}); }, 1e-3});
  }
  check({"sum of 2^20 + 4", {{(1 << 20) + 4}}, [](auto& v) { return sum(v[0]); }, 1e-3});
  // A row of more than 16384 chunks: its second pass must see all of them
  // (the last element alone is not zero).
  const int64_t huge = (int64_t{1} << 28) + 20000;
  Tensor z = zeros({huge}, {DType::Float32, Device::cuda()});
  z.narrow(0, huge - 1, 1).fill_(1.0);
  EXPECT_EQ(sum(z).item(), 1.0);
  Tensor i = arange(5000, {DType::Int64});
  EXPECT_EQ(sum(i.to(Device::cuda())).item(), sum(i).item());
}

TEST_F(CudaOps, Reductions) {
  manual_seed(3);
  check({"sum all", {{1000, 1025}}, [](auto& v) { return sum(v[0]); }, 1e-3});
  check({"sum 2^20+3", {{(1 << 20) + 3}}, [](auto& v) { return sum(v[0]); }, 1e-3});
  check({"sum dim", {{7, 33, 3}}, [](auto& v) { return sum(v[0], {1}); }});
  check({"sum dims keepdim", {{7, 33, 3}}, [](auto& v) { return sum(v[0], {0, 2}, true); }});
  check({"mean", {{1025, 3}}, [](auto& v) { return mean(v[0], {0}); }});
  check({"max last", {{7, 1025}}, [](auto& v) { return max(v[0], 1).first; }});
  check({"max first", {{1025, 3}}, [](auto& v) { return max(v[0], 0).first; }});
  Tensor x = randn({33, 1025});
  EXPECT_EQ(argmax(x, 1).to_vector<int64_t>(), argmax(x.to(Device::cuda()), 1).to_vector<int64_t>());
}

TEST_F(CudaOps, SoftmaxAndLosses) {
  manual_seed(4);
  check({"softmax", {{7, 1025}}, [](auto& v) { return softmax(v[0], -1); }});
  check({"softmax dim0", {{33, 3}}, [](auto& v) { return softmax(v[0], 0); }});
  check({"log_softmax", {{1000, 10}}, [](auto& v) { return log_softmax(v[0], 1); }});
  std::vector<int64_t> labels(1000);
  for (size_t i = 0; i < labels.size(); ++i) labels[i] = int64_t(i * 7 % 10);
  Tensor y = from_vector(labels, {1000});
  Tensor yg = y.to(Device::cuda());
  check({"cross_entropy", {{1000, 10}},
         [&](auto& v) { return cross_entropy(v[0], v[0].device().is_cuda() ? yg : y); }});
  check({"mse", {{33, 7}, {33, 7}}, [](auto& v) { return mse_loss(v[0], v[1]); }});
  check({"l1", {{1025}}, [](auto& v) { return l1_loss(v[0], zeros({1025}, v[0].options())); },
         1e-4, Input::AwayFromZero});
  EXPECT_THROW(cross_entropy(randn({2, 3}).to(Device::cuda()),
                             from_vector<int64_t>({0, 7}, {2}, Device::cuda())),
               std::invalid_argument)
      << "a label out of range is reported from the GPU too";
}

// Sums over leading dimensions go through the column kernel (up to
// kMaxColumnRows rows) and otherwise through the transposed row sums.
TEST_F(CudaOps, SumsOverLeadingDimensions) {
  manual_seed(14);
  check({"columns", {{128, 10}}, [](auto& v) { return sum(v[0], {0}); }});
  check({"columns of a 3-d", {{33, 7, 5}}, [](auto& v) { return sum(v[0], {0, 1}); }});
  check({"columns keepdim", {{33, 7, 5}}, [](auto& v) { return sum(v[0], {0}, true); }});
  check({"many rows", {{5000, 3}}, [](auto& v) { return sum(v[0], {0}); }, 1e-3});
  check({"a view", {{9, 40}}, [](auto& v) { return sum(v[0].narrow(1, 3, 30), {0}); }});
  check({"all", {{33, 7}}, [](auto& v) { return sum(v[0]); }});
  check({"mean of all", {{1000}}, [](auto& v) { return mean(v[0]); }});
  check({"mean of leading", {{33, 7, 5}}, [](auto& v) { return mean(v[0], {0, 1}); }});
  check({"columns, double", {{300, 7}}, [](auto& v) { return sum(v[0], {0}); }, 1e-9,
         Input::Any, DType::Float64});
  std::vector<int64_t> ints(600);
  for (size_t i = 0; i < ints.size(); ++i) ints[i] = int64_t(i * i % 1000) - 300;
  Tensor ic = from_vector(ints, {200, 3});
  EXPECT_EQ(sum(ic.to(Device::cuda()), {0}).to_vector<int64_t>(), sum(ic, {0}).to_vector<int64_t>())
      << "int64 column sums";
}

// Max pooling passes a NaN on as the CPU does (and as PyTorch does): the
// same outputs, NaN where the CPU has one, and the same gradient routes.
TEST_F(CudaOps, MaxPoolPassesNaNOnAsTheCpuDoes) {
  std::vector<float> v(2 * 3 * 7 * 9);
  for (size_t i = 0; i < v.size(); ++i) v[i] = float((i * 37) % 101) - 50.0f;
  for (size_t i : {0u, 10u, 11u, 40u, 64u, 200u, 201u, 377u}) v[i] = std::nanf("");
  for (const auto& [k, stride] : {std::pair{2, 2}, std::pair{3, 2}, std::pair{3, 3}}) {
    SCOPED_TRACE("window " + std::to_string(k) + " stride " + std::to_string(stride));
    Tensor xc = from_vector(v, {2, 3, 7, 9}).set_requires_grad(true);
    Tensor xg = from_vector(v, {2, 3, 7, 9}).to(Device::cuda()).set_requires_grad(true);
    Tensor yc = max_pool2d(xc, k, stride), yg = max_pool2d(xg, k, stride);
    const auto c = yc.to_vector<float>(), g = yg.to_vector<float>();
    ASSERT_EQ(c.size(), g.size());
    int nans = 0;
    for (size_t i = 0; i < c.size(); ++i) {
      if (std::isnan(c[i])) {
        ++nans;
        EXPECT_TRUE(std::isnan(g[i])) << "output " << i;
      } else {
        EXPECT_EQ(g[i], c[i]) << "output " << i;
      }
    }
    EXPECT_GT(nans, 0);
    sum(yc).backward();
    sum(yg).backward();
    EXPECT_EQ(xg.grad().to(Device::cpu()).to_vector<float>(), xc.grad().to_vector<float>());
  }
}

TEST_F(CudaOps, ConvPoolDropout) {
  manual_seed(5);
  check({"conv", {{2, 3, 7, 9}, {5, 3, 3, 3}, {5}},
         [](auto& v) { return conv2d(v[0], v[1], v[2], 1, 0); }, 1e-3});
  check({"conv pad stride", {{2, 3, 7, 9}, {4, 3, 3, 3}},
         [](auto& v) { return conv2d(v[0], v[1], Tensor(), 2, 1); }, 1e-3});
  check({"conv lenet", {{4, 1, 28, 28}, {6, 1, 5, 5}, {6}},
         [](auto& v) { return conv2d(v[0], v[1], v[2], 1, 2); }, 1e-3});
  // The direct kernels (kernels/conv.h): LeNet's second layer; a smaller
  // image whose weight gradient sums groups of images, with a batch that
  // leaves the last group short; more output channels than one thread's
  // block with a strided, padded, non-square kernel (the input gradient as
  // a gather); an output of 30 rows whose weight gradient is summed over
  // slices of rows, the last one short. Then a convolution too large for
  // them (im2col).
  const kernels::ConvGeometry lenet2{33, 6, 14, 14, 5, 5, 1, 0},
      grouped{34, 6, 10, 10, 5, 5, 1, 0}, wide{3, 2, 9, 11, 3, 5, 2, 2},
      sliced{3, 2, 30, 30, 3, 3, 1, 1}, large{2, 16, 40, 40, 3, 3, 1, 1};
  const auto p2 = kernels::plan_direct_conv(lenet2, 16, sizeof(float));
  ASSERT_TRUE(p2.fits && p2.input_as_convolution);
  const auto pg = kernels::plan_direct_conv(grouped, 16, sizeof(float));
  ASSERT_TRUE(pg.fits && pg.images_per_group > 1);
  ASSERT_GT(pg.groups * pg.images_per_group, 34) << "a short last group";
  const auto pw = kernels::plan_direct_conv(wide, 20, sizeof(float));
  ASSERT_TRUE(pw.fits && !pw.input_as_convolution);
  const auto ps = kernels::plan_direct_conv(sliced, 9, sizeof(float));
  ASSERT_TRUE(ps.fits && ps.slices > 1 && 30 % ps.rows_per_slice != 0) << "a short last slice";
  ASSERT_FALSE(kernels::plan_direct_conv(large, 4, sizeof(float)).fits);
  check({"conv direct lenet 2", {{33, 6, 14, 14}, {16, 6, 5, 5}, {16}},
         [](auto& v) { return conv2d(v[0], v[1], v[2], 1, 0); }, 1e-3});
  check({"conv direct grouped", {{34, 6, 10, 10}, {16, 6, 5, 5}, {16}},
         [](auto& v) { return conv2d(v[0], v[1], v[2], 1, 0, true); }, 1e-3});
  check({"conv direct wide", {{3, 2, 9, 11}, {20, 2, 3, 5}, {20}},
         [](auto& v) { return conv2d(v[0], v[1], v[2], 2, 2); }, 1e-3});
  check({"conv direct sliced", {{3, 2, 30, 30}, {9, 2, 3, 3}, {9}},
         [](auto& v) { return conv2d(v[0], v[1], v[2], 1, 1); }, 1e-3});
  // A 4-wide kernel: the weight gradient one tap a thread (5- and 3-wide
  // ones take five and three); padding 1 makes the input gradient's 2.
  check({"conv direct 4x4", {{3, 2, 9, 12}, {5, 2, 4, 4}, {5}},
         [](auto& v) { return conv2d(v[0], v[1], v[2], 1, 1); }, 1e-3});
  // Images staged without zero columns (they would not fit with them).
  const auto pu = kernels::plan_direct_conv({5, 6, 24, 24, 5, 5, 1, 0}, 16, sizeof(float));
  ASSERT_TRUE(pu.fits && !pu.padded);
  check({"conv direct unpadded", {{5, 6, 24, 24}, {16, 6, 5, 5}, {16}},
         [](auto& v) { return conv2d(v[0], v[1], v[2], 1, 0, true); }, 1e-3});
  check({"conv relu direct", {{33, 6, 14, 14}, {16, 6, 5, 5}, {16}},
         [](auto& v) { return conv2d(v[0], v[1], v[2], 1, 0, true); }, 1e-3});
  check({"conv relu gather", {{3, 2, 9, 11}, {20, 2, 3, 5}, {20}},
         [](auto& v) { return conv2d(v[0], v[1], v[2], 2, 2, true); }, 1e-3});
  check({"conv relu im2col", {{2, 16, 40, 40}, {4, 16, 3, 3}, {4}},
         [](auto& v) { return conv2d(v[0], v[1], v[2], 1, 1, true); }, 1e-3});
  {
    // One image per im2col chunk: single products small enough for the
    // small-product kernel, adding to the bias written first (beta = 1).
    const int64_t saved = conv_workspace_bytes();
    set_conv_workspace_bytes(1);
    check({"conv im2col, one image per chunk", {{2, 16, 40, 40}, {2, 16, 1, 1}, {2}},
           [](auto& v) { return conv2d(v[0], v[1], v[2], 1, 0); }, 1e-3});
    set_conv_workspace_bytes(saved);
  }
  check({"conv im2col", {{2, 16, 40, 40}, {4, 16, 3, 3}, {4}},
         [](auto& v) { return conv2d(v[0], v[1], v[2], 1, 1); }, 1e-3});
  check({"pool 2", {{2, 3, 7, 9}}, [](auto& v) { return max_pool2d(v[0], 2); }});
  check({"pool 3 s3", {{2, 3, 7, 9}}, [](auto& v) { return max_pool2d(v[0], 3, 3); }});
  check({"pool 2 s3 (gaps between windows)", {{2, 3, 8, 10}},
         [](auto& v) { return max_pool2d(v[0], 2, 3); }});
  check({"pool 3 s2 (overlapping windows)", {{2, 3, 9, 11}},
         [](auto& v) { return max_pool2d(v[0], 3, 2); }});
  // Only some inputs needing gradients: a frozen weight, then bias only.
  check({"conv direct, frozen weight", {{5, 6, 14, 14}, {16, 6, 5, 5}, {16}},
         [](auto& v) { return conv2d(v[0], v[1].detach(), v[2], 1, 0, true); }, 1e-3});
  check({"conv direct, bias only", {{5, 6, 14, 14}, {16, 6, 5, 5}, {16}},
         [](auto& v) { return conv2d(v[0].detach(), v[1].detach(), v[2], 1, 0); }, 1e-3});
  // A kernel two tap groups wide (6 = 2 × 3) in the weight gradient.
  check({"conv direct 3x6", {{3, 2, 9, 12}, {5, 2, 3, 6}, {5}},
         [](auto& v) { return conv2d(v[0], v[1], v[2], 1, 1); }, 1e-3});
  // float64 through the same kernels (two lanes per 16-byte word): LeNet's
  // second layer, which in doubles fits only unpadded, and a 5-wide kernel
  // that fits padded.
  ASSERT_FALSE(kernels::plan_direct_conv(lenet2, 16, sizeof(double)).padded);
  check({"conv direct double", {{33, 6, 14, 14}, {16, 6, 5, 5}, {16}},
         [](auto& v) { return conv2d(v[0], v[1], v[2], 1, 0, true); }, 1e-9, Input::Any,
         DType::Float64});
  const auto pd = kernels::plan_direct_conv({3, 2, 9, 9, 5, 5, 1, 2}, 8, sizeof(double));
  ASSERT_TRUE(pd.fits && pd.padded);
  check({"conv direct double, padded", {{3, 2, 9, 9}, {8, 2, 5, 5}, {8}},
         [](auto& v) { return conv2d(v[0], v[1], v[2], 1, 2, true); }, 1e-9, Input::Any,
         DType::Float64});
  check({"conv gather double", {{3, 2, 9, 11}, {20, 2, 3, 5}, {20}},
         [](auto& v) { return conv2d(v[0], v[1], v[2], 2, 2); }, 1e-9, Input::Any,
         DType::Float64});
  check({"pool 3 s1", {{2, 3, 7, 9}}, [](auto& v) { return max_pool2d(v[0], 3, 1); }});
  check({"dropout", {{1025}}, [](auto& v) {
           manual_seed(9);
           return dropout(v[0], 0.3, true);
         }});
  check({"add dropout", {{1025}, {1025}}, [](auto& v) {
           manual_seed(9);
           return add_dropout(v[0], v[1], 0.3, true);
         }});
  EXPECT_EQ(add_dropout_mismatch(Device::cuda()), "");
}

// Layer norm's backward adding its input's other gradient as it writes dx,
// through the scalar and register kernels: the same bits as the addition
// after (fused_check.h).
TEST_F(CudaOps, LayerNormTakesItsInputsOtherGradientBitForBit) {
  EXPECT_EQ(layer_norm_fold_mismatch(Device::cuda()), "");
}

// LeNet as the jobs build it: on CUDA, Sequential runs each Conv2d and
// Linear followed by a ReLU as one fused operation (direct convolution
// kernels, the bias and ReLU after the GEMM); on the CPU as separate ones.
// Loss and every parameter's gradient agree.
TEST_F(CudaOps, SequentialWithFusedReluMatchesTheCpu) {
  manual_seed(15);
  auto lenet = [] {
    return nn::Sequential(
        {std::make_shared<nn::Conv2d>(1, 6, 5, 1, 2), std::make_shared<nn::ReLU>(),
         std::make_shared<nn::MaxPool2d>(2), std::make_shared<nn::Conv2d>(6, 16, 5),
         std::make_shared<nn::ReLU>(), std::make_shared<nn::MaxPool2d>(2),
         std::make_shared<nn::Flatten>(), std::make_shared<nn::Linear>(400, 120),
         std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(120, 84),
         std::make_shared<nn::ReLU>(), std::make_shared<nn::Linear>(84, 10)});
  };
  nn::Sequential cpu = lenet(), gpu = lenet();
  auto pc = cpu.named_parameters(), pg = gpu.named_parameters();
  ASSERT_EQ(pc.size(), pg.size());
  for (size_t i = 0; i < pc.size(); ++i) {
    NoGradGuard no_grad;
    pg[i].second.copy_(pc[i].second);
  }
  gpu.to(Device::cuda());
  std::vector<int64_t> labels(37);
  for (size_t i = 0; i < labels.size(); ++i) labels[i] = int64_t(i * 7 % 10);
  Tensor x = randn({37, 1, 28, 28}), y = from_vector(labels, {37});
  Tensor lc = cross_entropy(cpu(x), y);
  Tensor lg = cross_entropy(gpu(x.to(Device::cuda())), y.to(Device::cuda()));
  EXPECT_LE(max_rel_diff(lg, lc), 1e-4) << "loss";
  lc.backward();
  lg.backward();
  pg = gpu.named_parameters();
  for (size_t i = 0; i < pc.size(); ++i) {
    ASSERT_TRUE(pg[i].second.grad().defined()) << pg[i].first;
    EXPECT_LE(max_rel_diff(pg[i].second.grad(), pc[i].second.grad()), 1e-3) << pg[i].first;
  }
}

TEST_F(CudaOps, OptimiserStepsMatch) {
  manual_seed(6);
  for (int which = 0; which < 2; ++which) {
    Tensor p0 = randn({1025}), g = randn({1025});
    Tensor pc = p0.clone().set_requires_grad(true);
    Tensor pg = p0.to(Device::cuda()).set_requires_grad(true);
    std::unique_ptr<optim::Optimizer> oc, og;
    if (which == 0) {
      oc = std::make_unique<optim::SGD>(nn::NamedTensors{{"p", pc}},
                                        optim::SgdOptions{.lr = 0.1, .momentum = 0.9,
                                                          .weight_decay = 0.01});
      og = std::make_unique<optim::SGD>(nn::NamedTensors{{"p", pg}},
                                        optim::SgdOptions{.lr = 0.1, .momentum = 0.9,
                                                          .weight_decay = 0.01});
    } else {
      oc = std::make_unique<optim::Adam>(nn::NamedTensors{{"p", pc}}, optim::AdamOptions{});
      og = std::make_unique<optim::Adam>(nn::NamedTensors{{"p", pg}}, optim::AdamOptions{});
    }
    for (int step = 0; step < 3; ++step) {
      pc.set_grad(g);
      pg.set_grad(g.to(Device::cuda()));
      oc->step();
      og->step();
    }
    EXPECT_LE(max_rel_diff(pg, pc), 1e-5) << (which ? "Adam" : "SGD");
  }
}

// Adam updates CUDA parameters up to 16 per launch: many of different
// sizes (some without a gradient) update as on the CPU.
TEST_F(CudaOps, FusedAdamOverManyParametersMatchesTheCpu) {
  manual_seed(8);
  nn::NamedTensors cpu_params, gpu_params;
  std::vector<Tensor> grads;
  for (int i = 0; i < 21; ++i) {
    const int64_t n = i % 3 == 0 ? 1 : (i * 997) % 5000 + 3;
    Tensor p0 = randn({n});
    cpu_params.emplace_back("p" + std::to_string(i), p0.clone().set_requires_grad(true));
    gpu_params.emplace_back("p" + std::to_string(i), p0.to(Device::cuda()).set_requires_grad(true));
    grads.push_back(randn({n}));
  }
  optim::AdamOptions o;
  o.weight_decay = 0.01;
  optim::Adam oc(cpu_params, o), og(gpu_params, o);
  for (int step = 0; step < 3; ++step) {
    for (size_t i = 0; i < grads.size(); ++i) {
      if (i == 5) continue;  // no gradient: left alone
      cpu_params[i].second.set_grad(grads[i]);
      gpu_params[i].second.set_grad(grads[i].to(Device::cuda()));
    }
    oc.step();
    og.step();
  }
  for (size_t i = 0; i < grads.size(); ++i) {
    EXPECT_LE(max_rel_diff(gpu_params[i].second, cpu_params[i].second), 1e-5) << "parameter " << i;
  }
}

// A training step in its steady state makes the host wait for the device
// zero times: batches gathered on the device from a resident dataset, bad
// labels counted on the device (DeferredLabelCheck), the loss summed there.
// A bad label is still caught when the check is read, naming it.
TEST_F(CudaOps, ASteadyStateTrainingStepNeverWaitsForTheDevice) {
  manual_seed(3);
  const Device dev = Device::cuda();
  const TensorOptions on{DType::Float32, dev};
  std::vector<int64_t> labels(512);
  for (int i = 0; i < 512; ++i) labels[i] = i % 10;
  data::Dataset d{randn({512, 1, 28, 28}).to(dev), from_vector(labels, {512}, dev)};
  nn::Sequential model({std::make_shared<nn::Conv2d>(1, 4, 5, 1, 0, true, on),
                        std::make_shared<nn::ReLU>(), std::make_shared<nn::MaxPool2d>(2),
                        std::make_shared<nn::Flatten>(), std::make_shared<nn::Dropout>(0.2),
                        std::make_shared<nn::Linear>(4 * 12 * 12, 10, true, on)});
  optim::Adam opt(model.named_parameters(), {});
  DeferredLabelCheck check(dev);
  data::BatchIterator it(d, 64, true, 1);
  it.start_epoch(0);
  Tensor loss_acc = zeros({}, on);
  auto step = [&] {
    Tensor x, y;
    ASSERT_TRUE(it.next(x, y, dev));
    opt.zero_grad();
    Tensor loss = cross_entropy(model(x), y);
    loss.backward();
    opt.step();
    NoGradGuard no_grad;
    loss_acc = add(loss_acc, loss.detach());
  };
  step();  // the epoch's order goes to the device, Adam makes its state
  step();
  const uint64_t before = host_waits();
  for (int i = 0; i < 4; ++i) step();
  EXPECT_EQ(host_waits() - before, 0u) << "a steady-state step waited for the device";
  EXPECT_NO_THROW(check.check());
  EXPECT_TRUE(std::isfinite(loss_acc.item()));

  labels[7] = 12;
  data::Dataset bad{d.images, from_vector(labels, {512}, dev)};
  data::BatchIterator all(bad, 512, false, 0);
  Tensor x, y;
  ASSERT_TRUE(all.next(x, y, dev));
  cross_entropy(model(x), y);  // no error yet: it is counted on the device
  try {
    check.check();
    ADD_FAILURE() << "a bad label went unnoticed";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("outside [0, 10), for example 12"), std::string::npos)
        << e.what();
  }
}

// Parameter initialisation draws the same values on CPU and GPU.
TEST_F(CudaOps, RandMatchesTheCpu) {
  for (DType dt : {DType::Float32, DType::Float64}) {
    manual_seed(11);
    Tensor cpu = rand({1000, 1025}, {dt}, -0.2, 0.7);
    manual_seed(11);
    Tensor gpu = rand({1000, 1025}, {dt, Device::cuda()}, -0.2, 0.7);
    ASSERT_EQ(gpu.device(), Device::cuda());
    EXPECT_EQ(max_rel_diff(gpu, cpu), 0.0) << dtype_name(dt);
  }
}

// Row gathers (the data loader's batches from a resident dataset): every
// word path (bytes, 4-byte and 16-byte words) against the CPU, with
// repeated and out-of-order indices.
TEST_F(CudaOps, TakeRowsMatchesTheCpu) {
  manual_seed(8);
  for (const Shape& shape : {Shape{7}, Shape{33, 3}, Shape{100, 4}, Shape{257, 1, 28, 28}}) {
    SCOPED_TRACE(shape_to_string(shape));
    Tensor x = randn(shape);
    std::vector<int64_t> idx;
    for (int64_t i = 0; i < 2 * shape[0]; ++i) idx.push_back((i * 7919) % shape[0]);
    Tensor index = from_vector(idx, {static_cast<int64_t>(idx.size())});
    Tensor cpu = take_rows(x, index);
    Tensor gpu = take_rows(x.to(Device::cuda()), index.to(Device::cuda()));
    ASSERT_EQ(gpu.sizes(), cpu.sizes());
    EXPECT_EQ(gpu.to_vector<float>(), cpu.to_vector<float>());
  }
  // int64 rows of 8 bytes (labels), and float64.
  Tensor labels = arange(1000, {DType::Int64});
  Tensor index = from_vector<int64_t>({999, 0, 500, 500, 3}, {5});
  EXPECT_EQ(take_rows(labels.to(Device::cuda()), index.to(Device::cuda())).to_vector<int64_t>(),
            (std::vector<int64_t>{999, 0, 500, 500, 3}));
  Tensor d = randn({9, 3}, {DType::Float64});
  EXPECT_EQ(take_rows(d.to(Device::cuda()), index.narrow(0, 1, 1).to(Device::cuda()))
                .to_vector<double>(),
            d.narrow(0, 0, 1).to_vector<double>());
}

// A text corpus's windows and their successors, gathered from its bytes on
// the device as on the CPU: every byte value, windows that overlap and
// repeat, at any offset into the int64 words that hold them.
TEST_F(CudaOps, TakeByteWindowsMatchesTheCpu) {
  std::vector<uint8_t> bytes(1000);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>((i * 7919) >> 3);
  const data::Dataset d = data::text_windows(bytes.data(), 999, 13);
  const Tensor on_gpu = d.text.to(Device::cuda());
  std::vector<int64_t> idx;
  for (int64_t i = 0; i < 2 * d.size(); ++i) idx.push_back((i * 31) % d.size());
  const Tensor index = from_vector(idx, {static_cast<int64_t>(idx.size())});
  for (int64_t offset : {0, 1}) {
    const Tensor cpu = take_byte_windows(d.text, 999, index, 13, 13, offset);
    const Tensor gpu = take_byte_windows(on_gpu, 999, index.to(Device::cuda()), 13, 13, offset);
    ASSERT_EQ(gpu.sizes(), cpu.sizes());
    EXPECT_EQ(gpu.to_vector<int64_t>(), cpu.to_vector<int64_t>()) << "offset " << offset;
  }
}

// Batches gathered on the device from a resident dataset are the batches the
// host path builds and copies over.
TEST_F(CudaOps, BatchesFromADatasetOnTheDeviceMatchTheHostPath) {
  manual_seed(9);
  data::Dataset host{randn({300, 1, 8, 8}), arange(300, {DType::Int64})};
  data::Dataset resident{host.images.to(Device::cuda()), host.labels.to(Device::cuda())};
  for (bool shuffle : {true, false}) {
    data::BatchIterator a(host, 64, shuffle, 5), b(resident, 64, shuffle, 5);
    for (int64_t epoch = 0; epoch < 2; ++epoch) {
      a.start_epoch(epoch);
      b.start_epoch(epoch);
      Tensor xa, ya, xb, yb;
      int batches = 0;
      while (a.next(xa, ya, Device::cuda())) {
        ASSERT_TRUE(b.next(xb, yb, Device::cuda()));
        EXPECT_EQ(xb.device(), Device::cuda());
        EXPECT_EQ(xb.to_vector<float>(), xa.to_vector<float>());
        EXPECT_EQ(yb.to_vector<int64_t>(), ya.to_vector<int64_t>());
        ++batches;
      }
      EXPECT_FALSE(b.next(xb, yb, Device::cuda()));
      EXPECT_EQ(batches, 5);
    }
  }
}

// A dataset in host memory reaches the device through pinned buffers a
// loader thread fills ahead: taking a batch never makes the host wait for
// the device, and the batches are those the CPU path gives, epoch by epoch.
TEST_F(CudaOps, BatchesFromAHostDatasetNeverMakeTheHostWait) {
  manual_seed(4);
  data::Dataset host{randn({1000, 1, 6, 6}), arange(1000, {DType::Int64})};
  data::BatchIterator on_gpu(host, 96, true, 7), on_cpu(host, 96, true, 7);
  std::vector<Tensor> xs, ys;
  Tensor x, y;
  ASSERT_TRUE(on_gpu.next(x, y, Device::cuda()));  // creates the pinned buffers
  xs.push_back(x);
  ys.push_back(y);
  const uint64_t waits = host_waits();
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    if (epoch > 0) on_gpu.start_epoch(epoch);
    while (on_gpu.next(x, y, Device::cuda())) {
      EXPECT_EQ(x.device(), Device::cuda());
      xs.push_back(x);
      ys.push_back(y);
    }
  }
  EXPECT_EQ(host_waits(), waits) << "no batch waited for the device";
  size_t i = 0;
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    on_cpu.start_epoch(epoch);
    while (on_cpu.next(x, y, Device::cpu())) {
      ASSERT_LT(i, xs.size());
      EXPECT_EQ(xs[i].to_vector<float>(), x.to_vector<float>()) << "batch " << i;
      EXPECT_EQ(ys[i].to_vector<int64_t>(), y.to_vector<int64_t>()) << "batch " << i;
      ++i;
    }
  }
  EXPECT_EQ(i, xs.size());
  EXPECT_EQ(i, 3u * 11u);
}

// A fault ends the context for good and is reported as such; an ordinary
// error (out of memory) is not. In a child process (the threadsafe death
// test style runs the test binary afresh): the fault would end this one's
// context too.
TEST_F(CudaOps, ALostContextIsReportedAndAnOrdinaryErrorIsNot) {
  const Device dev = Device::cuda(0);
#ifdef LEASEHOLD_HAVE_CUDA  // (this file also builds without CUDA, where it skips)
  void* p = nullptr;
  ASSERT_NE(cudaMalloc(&p, size_t{1} << 62), cudaSuccess);  // left as the last error
  EXPECT_EQ(device_context_lost(dev), std::nullopt) << "out of memory leaves the context usable";
#endif
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        inject_device_fault(dev);
        auto lost = device_context_lost(dev);
        auto again = device_context_lost(dev);
        std::fprintf(stderr, "lost: %s; again: %s\n", lost ? lost->c_str() : "none",
                     again ? again->c_str() : "none");
        std::_Exit(lost && again ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "lost: cudaErrorIllegalAddress.*again: cudaErrorIllegalAddress");
  EXPECT_EQ(device_context_lost(dev), std::nullopt) << "this process's context is untouched";
}

}  // namespace
}  // namespace leasehold::engine::testing
