// Engine benchmark, printed as JSON:
//  - GEMM TFLOP/s of the engine's matmul beside raw cuBLAS (FP32 and TF32);
//  - elementwise and reduction GB/s beside a device-to-device copy;
//  - one Fashion-MNIST MLP training step (784-256-128-10, batch 128, Adam),
//    to compare with tests/bench/torch_mlp_step.py on the same GPU.
// Without a GPU only the CPU training step is measured.
//
//   leasehold-bench-engine [--gemm 4096,8192] [--elements 67108864]
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <optional>
#include <nlohmann/json.hpp>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>
#include <sstream>
#include <vector>

#include "agent/engine/autocast.h"
#include "agent/engine/autograd.h"
#include "agent/engine/cuda_context.h"
#include "agent/engine/nn.h"
#include "agent/engine/ops.h"
#include "agent/engine/optim.h"
#include "agent/engine/step_graph.h"
#include "shared/device.h"
#include "tests/engine/op_registry.h"
#ifdef LEASEHOLD_HAVE_CUDA
#include <cublas_v2.h>

#include "kernels/matmul.h"

#include "shared/cuda_check.h"
#endif

namespace E = leasehold::engine;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median seconds of `fn` on the CPU clock (fn must synchronize if needed).
double time_host(const std::function<void()>& fn, int warmup, int reps) {
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    fn();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return median(t);
}

nlohmann::json mlp_step(E::Device device) {
  E::manual_seed(0);
  E::nn::Sequential model({std::make_shared<E::nn::Flatten>(),
                           std::make_shared<E::nn::Linear>(784, 256),
                           std::make_shared<E::nn::ReLU>(),
                           std::make_shared<E::nn::Linear>(256, 128),
                           std::make_shared<E::nn::ReLU>(),
                           std::make_shared<E::nn::Linear>(128, 10)});
  model.to(device);
  E::optim::Adam opt(model.named_parameters(), {.lr = 1e-3});
  E::Tensor x = E::randn({128, 1, 28, 28}).to(device);
  std::vector<int64_t> labels(128);
  for (int i = 0; i < 128; ++i) labels[i] = i % 10;
  E::Tensor y = E::from_vector(labels, {128}, device);
  auto step = [&] {
    opt.zero_grad();
    E::cross_entropy(model(x), y).backward();
    opt.step();
#ifdef LEASEHOLD_HAVE_CUDA
    if (device.is_cuda()) E::synchronize(device.index);
#endif
  };
  double s = time_host(step, 20, device.is_cuda() ? 300 : 50);
  return {{"device", device.str()}, {"batch", 128}, {"step_ms", s * 1e3},
          {"samples_per_second", 128 / s}};
}

#ifdef LEASEHOLD_HAVE_CUDA
// Median seconds per call of `fn` on the compute stream, timed with events.
double time_device(const std::function<void()>& fn, int warmup, int reps) {
  cudaStream_t s = E::compute_stream(0);
  for (int i = 0; i < warmup; ++i) fn();
  cudaEvent_t a, b;
  LEASEHOLD_CUDA_CHECK(cudaEventCreate(&a));
  LEASEHOLD_CUDA_CHECK(cudaEventCreate(&b));
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    LEASEHOLD_CUDA_CHECK(cudaEventRecord(a, s));
    fn();
    LEASEHOLD_CUDA_CHECK(cudaEventRecord(b, s));
    LEASEHOLD_CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    LEASEHOLD_CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms / 1e3);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return median(t);
}

nlohmann::json gemm(int64_t n) {
  E::Device gpu = E::Device::cuda(0);
  E::Tensor a = E::randn({n, n}).to(gpu), b = E::randn({n, n}).to(gpu);
  E::Tensor c = E::empty({n, n}, {E::DType::Float32, gpu});
  double flops = 2.0 * n * n * n;
  nlohmann::json out{{"n", n}};
  for (bool tf32 : {false, true}) {
    E::set_allow_tf32(tf32);
    double t_engine = time_device([&] { E::matmul(a, b); }, 3, 10);
    cublasHandle_t h = E::cublas_handle(0);
    float one = 1, zero = 0;
    auto compute = tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
    double t_cublas = time_device(
        [&] {
          if (cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, b.data<float>(), CUDA_R_32F,
                           n, a.data<float>(), CUDA_R_32F, n, &zero, c.data<float>(), CUDA_R_32F,
                           n, compute, CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
            throw std::runtime_error("cublasGemmEx failed");
          }
        },
        3, 10);
    std::string k = tf32 ? "tf32" : "fp32";
    out["engine_" + k + "_tflops"] = flops / t_engine / 1e12;
    out["cublas_" + k + "_tflops"] = flops / t_cublas / 1e12;
  }
  E::set_allow_tf32(false);
  return out;
}

nlohmann::json bandwidth(int64_t n) {
  E::Device gpu = E::Device::cuda(0);
  E::Tensor a = E::randn({n}).to(gpu), b = E::randn({n}).to(gpu);
  E::Tensor dst = E::empty({n}, {E::DType::Float32, gpu});
  E::Tensor rows = E::randn({n / 1024, 1024}).to(gpu);
  double bytes = 4.0 * n;
  cudaStream_t s = E::compute_stream(0);
  double t_copy = time_device(
      [&] {
        LEASEHOLD_CUDA_CHECK(cudaMemcpyAsync(dst.data<float>(), a.data<float>(), bytes,
                                             cudaMemcpyDeviceToDevice, s));
      },
      3, 20);
  double t_add = time_device([&] { E::add(a, b); }, 3, 20);
  double t_relu = time_device([&] { E::relu(a); }, 3, 20);
  // The same on views one element off 16-byte alignment: the 4-byte path
  // the contiguous operators took before they moved 16-byte words.
  E::Tensor a1 = a.narrow(0, 1, n - 1), b1 = b.narrow(0, 1, n - 1);
  double t_add4 = time_device([&] { E::add(a1, b1); }, 3, 20);
  double t_relu4 = time_device([&] { E::relu(a1); }, 3, 20);
  double t_sum = time_device([&] { E::sum(a); }, 3, 20);
  double t_rowsum = time_device([&] { E::sum(rows, {1}); }, 3, 20);
  double t_softmax = time_device([&] { E::softmax(rows, 1); }, 3, 20);
  // Bytes that must move: each input read once, each output written once.
  return {{"elements", n},
          {"d2d_copy_gbs", 2 * bytes / t_copy / 1e9},
          {"add_gbs", 3 * bytes / t_add / 1e9},
          {"relu_gbs", 2 * bytes / t_relu / 1e9},
          {"add_4byte_gbs", 3 * bytes / t_add4 / 1e9},
          {"relu_4byte_gbs", 2 * bytes / t_relu4 / 1e9},
          {"sum_all_gbs", bytes / t_sum / 1e9},
          {"sum_rows_1024_gbs", bytes / t_rowsum / 1e9},
          {"softmax_rows_1024_gbs", 2 * bytes / t_softmax / 1e9}};
}
#endif

#ifdef LEASEHOLD_HAVE_CUDA
// Causal attention at the GPT job's shapes (batch × heads × tokens × head
// size): float32 tensors through the float32 kernels ("fp32") and through
// the bfloat16 tensor-core ones that autocast picks ("bf16"), and bfloat16
// tensors (the GPT block's path: its projection kept in bfloat16) through
// the same ("bf16_io"). Milliseconds per forward and per forward and
// backward (tests/bench/attention_torch.py times PyTorch's SDPA, bfloat16
// tensors, on the same shapes).
nlohmann::json attention(const E::Shape& shape) {
  nlohmann::json out{{"shape", shape}};
  for (const char* key : {"fp32", "bf16", "bf16_io"}) {
    const bool mixed = std::string(key) != "fp32", bf16_io = std::string(key) == "bf16_io";
    E::manual_seed(2);
    const E::Device cuda = E::Device::cuda(0);
    std::vector<E::Tensor> qkv;
    for (int i = 0; i < 3; ++i) {
      E::Tensor t = E::randn(shape).to(cuda);
      if (bf16_io) t = t.to(E::DType::BFloat16);
      qkv.push_back(t.set_requires_grad(true));
    }
    E::Tensor g = E::randn(shape).to(cuda);
    if (bf16_io) g = g.to(E::DType::BFloat16);
    std::optional<E::DType> precision;
    if (mixed) precision = E::DType::BFloat16;
    auto forward = [&] {
      E::AutocastGuard autocast(precision);
      E::NoGradGuard no_grad;
      E::scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], true);
    };
    auto both = [&] {
      E::AutocastGuard autocast(precision);
      for (E::Tensor& t : qkv) t.set_grad(E::Tensor());
      E::scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], true).backward(g);
    };
    out[std::string(key) + "_forward_ms"] = time_device(forward, 5, 30) * 1e3;
    out[std::string(key) + "_forward_backward_ms"] = time_device(both, 5, 30) * 1e3;
  }
  return out;
}

// The GPT block's linear layers under autocast at its shapes (rows = batch ×
// context), as a training step runs them: the engine's forward (linear on a
// bfloat16 input, its weight's and bias's bfloat16 copies made by the
// step's one pass (AutocastWeights), its bias fused, a bfloat16 result;
// fc1 with GELU) against cuBLASLt's plain product of the same operands
// into the same output type, and against cuBLASLt with the same epilogue
// (bias, and GELU with its input kept), TFLOP/s. Each timing is of a CUDA
// graph of 20 calls, as a step's graph launches them: the device's time,
// not the host's (a call alone, or calls queued op by op, time what the
// host takes to issue them). weight_copy_us: that layer's share of the
// step's copy pass, timed as a pass of its own (a graph of 20 passes).

nlohmann::json linear_layers(int64_t rows) {
  struct Layer {
    const char* name;
    int64_t in, out;
    bool gelu;
  };
  const Layer layers[] = {{"qkv", 384, 1152, false},
                          {"proj", 384, 384, false},
                          {"fc1_gelu", 384, 1536, true},
                          {"fc2", 1536, 384, false}};
  nlohmann::json out = nlohmann::json::array();
  const E::Device cuda = E::Device::cuda(0);
  constexpr int kCalls = 20;
  // A graph of kCalls calls of fn, timed per call. fn runs once op by op
  // first, as a job's first step does: the products' algorithms are chosen
  // there (matmul.h), never under capture.
  auto per_call = [&](const std::function<void()>& fn) {
    fn();
    E::StepGraph graph(cuda, [&fn] {
      for (int i = 0; i < kCalls; ++i) fn();
    });
    return time_device(
               [&] {
                 if (!graph.run()) throw std::runtime_error("graph: " + graph.why_not());
               },
               3, 10) /
           kCalls;
  };
  for (const Layer& l : layers) {
    E::manual_seed(3);
    const E::Tensor x = E::randn({rows, l.in}).to(cuda).to(E::DType::BFloat16);
    const E::Tensor w = E::mul(E::randn({l.out, l.in}), 0.05).to(cuda);
    const E::Tensor b = E::randn({l.out}).to(cuda);
    const std::vector<E::Tensor> params = {w, b};
    E::AutocastGuard autocast(E::DType::BFloat16);
    E::NoGradGuard no_grad;
    // cuBLASLt alone into preallocated outputs: the plain product, and the
    // product with the layer's epilogue.
    const E::Tensor w16 = w.to(E::DType::BFloat16), b16 = b.to(E::DType::BFloat16);
    const E::Tensor c = E::empty({rows, l.out}, {E::DType::BFloat16, cuda});
    const E::Tensor aux = E::empty({rows, l.out}, {E::DType::BFloat16, cuda});
    constexpr size_t kWork = leasehold::kernels::cuda::kLtMaxWorkspaceBytes;
    const E::Tensor work = E::empty({static_cast<int64_t>(kWork / 8)}, {E::DType::Int64, cuda});
    leasehold::kernels::GemmShape gs;
    gs.trans_b = true;
    gs.m = rows;
    gs.n = l.out;
    gs.k = l.in;
    gs.lda = l.in;
    gs.ldb = l.in;
    gs.ldc = l.out;
    auto raw = [&](const leasehold::kernels::GemmEpilogue& e) {
      return [&, e] {
        if (!leasehold::kernels::cuda::gemm_bf16_fused(
                E::cublaslt_handle(0), E::compute_stream(0), gs, x.data<E::bfloat16>(),
                w16.data<E::bfloat16>(), c.raw_data(), leasehold::kernels::GemmOut::BFloat16, e,
                work.raw_data(), kWork)) {
          throw std::runtime_error("cuBLASLt has no algorithm for the product");
        }
      };
    };
    leasehold::kernels::GemmEpilogue same;
    same.bias = b16.raw_data();
    if (l.gelu) same.gelu_input = aux.data<E::bfloat16>();
    // cuBLASLt's heuristic's first choice (plans made with the measured
    // choice off, before anything else ran these shapes on this thread),
    // then the same plans measured.
    leasehold::kernels::cuda::set_gemm_measured_choice(false);
    const double t_raw_first = per_call(raw({}));
    const double t_same_first = per_call(raw(same));
    leasehold::kernels::cuda::set_gemm_measured_choice(true);
    const double t_raw = per_call(raw({}));
    const double t_same = per_call(raw(same));
    // The engine's layer (its products' plans, those above: measured).
    auto copy_pass = [&] { E::AutocastWeights copies(params); };
    const double t_copy = per_call(copy_pass);
    double t_layer = 0;
    {
      E::AutocastWeights copies(params);
      t_layer = per_call([&] {
        if (l.gelu) {
          E::linear_gelu(x, w, b);
        } else {
          E::linear(x, w, b, false, E::ProductOut::LowerPrecision);
        }
      });
    }
    const auto choice = [&](const leasehold::kernels::GemmEpilogue& e) {
      const auto c = leasehold::kernels::cuda::gemm_bf16_fused_choice(
          E::cublaslt_handle(0), gs, leasehold::kernels::GemmOut::BFloat16, e);
      return std::to_string(c.chosen) + " of " + std::to_string(c.candidates);
    };
    const double flop = 2.0 * rows * l.in * l.out;
    out.push_back({{"layer", l.name},
                   {"rows", rows},
                   {"in", l.in},
                   {"out", l.out},
                   {"engine_tflops", flop / t_layer / 1e12},
                   {"cublaslt_tflops", flop / t_raw / 1e12},
                   {"cublaslt_same_epilogue_tflops", flop / t_same / 1e12},
                   {"cublaslt_heuristic_first_tflops", flop / t_raw_first / 1e12},
                   {"cublaslt_same_epilogue_heuristic_first_tflops", flop / t_same_first / 1e12},
                   {"algorithm", choice({})},
                   {"algorithm_same_epilogue", choice(same)},
                   {"ratio", t_raw / t_layer},
                   {"ratio_same_epilogue", t_same / t_layer},
                   {"weight_copy_us", t_copy * 1e6}});
  }
  return out;
}
#endif

// Every registered operator (tests/engine/op_registry.h) at its test shapes
// in float32: forward, then forward and backward, in microseconds per call
// (median; CUDA timed with events on the compute stream, so small shapes
// show what a launch costs rather than a kernel's bandwidth).
nlohmann::json registered_ops(E::Device device) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& c : E::testing::op_cases()) {
    E::manual_seed(1);
    std::vector<E::Tensor> inputs;
    for (const E::Tensor& t : c.inputs()) {
      inputs.push_back(t.to(E::DType::Float32).to(device).set_requires_grad(true));
    }
    auto forward = [&] {
      E::NoGradGuard no_grad;
      c.fn(inputs);
    };
    auto both = [&] {
      for (E::Tensor& t : inputs) t.set_grad(E::Tensor());
      E::sum(c.fn(inputs)).backward();
    };
    const int reps = device.is_cuda() ? 200 : 20;
    auto seconds = [&](const std::function<void()>& fn) {
#ifdef LEASEHOLD_HAVE_CUDA
      if (device.is_cuda()) return time_device(fn, 10, reps);
#endif
      return time_host(fn, 2, reps);
    };
    out.push_back({{"op", c.name},
                   {"forward_us", seconds(forward) * 1e6},
                   {"forward_backward_us", seconds(both) * 1e6}});
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"leasehold engine benchmark"};
  std::string gemm_sizes = "4096,8192";
  int64_t elements = 1 << 26;
  app.add_option("--gemm", gemm_sizes, "square GEMM sizes")->capture_default_str();
  app.add_option("--elements", elements, "elements for the bandwidth tests")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  // (stdout is the JSON: the engine's log lines go to stderr.)
  spdlog::set_default_logger(spdlog::stderr_logger_st("leasehold-bench-engine"));
  try {
    nlohmann::json out;
    out["mlp_step_cpu"] = mlp_step(E::Device::cpu());
#ifdef LEASEHOLD_HAVE_CUDA
    if (leasehold::cuda_device_count() > 0) {
      // Tensors here come from the default allocator (cudaMallocAsync). It
      // keeps freed memory, as a job's caching lease allocator does, rather
      // than handing it back to the driver at every synchronization (what
      // the default threshold of 0 does: a 256 MiB output mapped again for
      // every call would be timed, not the kernel).
      cudaMemPool_t mempool;
      LEASEHOLD_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&mempool, 0));
      uint64_t keep = UINT64_MAX;
      LEASEHOLD_CUDA_CHECK(cudaMemPoolSetAttribute(mempool, cudaMemPoolAttrReleaseThreshold, &keep));
      auto mem = leasehold::query_device_memory(leasehold::Backend::Cuda, 0);
      out["device"] = mem.name;
      out["mlp_step_cuda"] = mlp_step(E::Device::cuda(0));
      out["gemm"] = nlohmann::json::array();
      std::stringstream ss(gemm_sizes);
      for (std::string item; std::getline(ss, item, ',');) {
        out["gemm"].push_back(gemm(std::stoll(item)));
      }
      out["bandwidth"] = bandwidth(elements);
      out["attention"] = attention({64, 6, 256, 64});
      out["linear_bf16"] = linear_layers(64 * 256);
      out["ops_cuda"] = registered_ops(E::Device::cuda(0));
    }
#endif
    if (!out.contains("ops_cuda")) out["ops_cpu"] = registered_ops(E::Device::cpu());
    std::printf("%s\n", out.dump(2).c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "leasehold-bench-engine: %s\n", e.what());
    return 1;
  }
  return 0;
}
