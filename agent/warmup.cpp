#include "agent/warmup.h"

#include "agent/engine/allocator.h"
#include "agent/engine/autograd.h"
#include "agent/engine/cuda_context.h"
#include "agent/engine/data.h"
#include "agent/engine/nn.h"
#include "agent/engine/ops.h"
#include "agent/engine/optim.h"

#ifdef LEASEHOLD_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "shared/cuda_check.h"
#endif

namespace leasehold {
namespace {

namespace E = engine;
using std::make_shared;

// One training step and an evaluation of `model` on batches of `data`.
void train_and_evaluate(E::nn::Sequential& model, const E::data::Dataset& data,
                        E::optim::Optimizer& opt, E::Device device) {
  E::data::BatchIterator batches(data, data.size(), true, 1);
  E::Tensor x, y;
  batches.next(x, y, device);
  opt.zero_grad();
  E::Tensor loss = E::cross_entropy(model(x), y);
  loss.backward();
  opt.step();
  E::Tensor acc = E::zeros({}, {E::DType::Float32, device});
  {
    E::NoGradGuard no_grad;
    acc = E::add(acc, loss.detach());
    model.eval();
    E::data::BatchIterator eval(data, data.size(), false, 0);
    eval.next(x, y, device);
    E::sum(E::eq(E::argmax(model(x), 1), y)).item();
    model.train();
  }
  acc.item();
}

E::data::Dataset dataset(int64_t n, E::Shape example, E::Device device) {
  E::Shape shape{n};
  shape.insert(shape.end(), example.begin(), example.end());
  std::vector<int64_t> labels(n);
  for (int64_t i = 0; i < n; ++i) labels[i] = i % 3;
  return {E::randn(shape).to(device), E::from_vector(labels, {n}).to(device)};
}

}  // namespace

void warm_up(E::Device device) {
  E::manual_seed(1);  // jobs seed the generator themselves
  {
    // Every layer type, both optimisers, and batches gathered on the device
    // (take_rows) and copied from the host (from_vector).
    // Built on the device, as jobs build theirs (the initialisation kernel).
    const E::TensorOptions on{E::DType::Float32, device};
    E::nn::Sequential cnn({make_shared<E::nn::Conv2d>(1, 4, 3, 1, 1, true, on),
                           make_shared<E::nn::ReLU>(), make_shared<E::nn::MaxPool2d>(2),
                           make_shared<E::nn::Flatten>(), make_shared<E::nn::Dropout>(0.5),
                           make_shared<E::nn::Linear>(4 * 4 * 4, 3, true, on)});
    E::optim::Adam adam(cnn.named_parameters(), {});
    E::optim::SGD sgd(cnn.named_parameters(), {.lr = 0.01, .momentum = 0.9, .weight_decay = 1e-4});
    E::data::Dataset resident = dataset(16, {1, 8, 8}, device);
    E::data::Dataset host = dataset(16, {1, 8, 8}, E::Device::cpu());
    train_and_evaluate(cnn, resident, adam, device);
    train_and_evaluate(cnn, host, sgd, device);
    // The example MLP's shapes (cuBLAS picks its kernels by shape).
    E::nn::Sequential mlp({make_shared<E::nn::Flatten>(),
                           make_shared<E::nn::Linear>(784, 256, true, on),
                           make_shared<E::nn::ReLU>(), make_shared<E::nn::Linear>(256, 128, true, on),
                           make_shared<E::nn::ReLU>(), make_shared<E::nn::Linear>(128, 10, true, on)});
    E::optim::Adam mlp_adam(mlp.named_parameters(), {});
    train_and_evaluate(mlp, dataset(128, {1, 28, 28}, device), mlp_adam, device);
  }
#ifdef LEASEHOLD_HAVE_CUDA
  if (device.is_cuda()) {
    // The tensors went back to the stream-ordered allocator's pool; hand
    // that memory back to the device: jobs use the coordinator's pool.
    E::synchronize(device.index);
    cudaMemPool_t pool;
    LEASEHOLD_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device.index));
    LEASEHOLD_CUDA_CHECK(cudaMemPoolTrimTo(pool, 0));
  }
#endif
}

}  // namespace leasehold
