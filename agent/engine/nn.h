// Neural-network modules with PyTorch's default initialisations. Parameters
// are leaf tensors that require grad, enumerable by dotted name
// ("0.weight" for the first child of a Sequential).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "agent/engine/tensor.h"

namespace leasehold::engine::nn {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

class Module {
 public:
  virtual ~Module() = default;
  virtual Tensor forward(const Tensor& x) = 0;
  Tensor operator()(const Tensor& x) { return forward(x); }
  // relu(forward(x)); layers that can fuse the ReLU into their own kernels
  // override it. Sequential calls it for a layer followed by a ReLU.
  virtual Tensor forward_then_relu(const Tensor& x);
  // "Linear(784 -> 256)" etc.
  virtual std::string describe() const = 0;

  NamedTensors named_parameters() const;
  std::vector<Tensor> parameters() const;
  int64_t parameter_count() const;
  // Training mode (dropout active) is the default.
  void train(bool on = true);
  void eval() { train(false); }
  bool is_training() const { return training_; }
  // Moves parameters to `device` (they stay leaves that require grad).
  void to(Device device);

 protected:
  Tensor& add_parameter(const std::string& name, Tensor t);
  void add_child(std::shared_ptr<Module> child);
  Tensor& param(size_t i) { return params_[i].second; }
  const Tensor& param(size_t i) const { return params_[i].second; }

 private:
  NamedTensors params_;
  std::vector<std::shared_ptr<Module>> children_;
  bool training_ = true;
};

class Linear final : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias = true,
         TensorOptions options = {});
  Tensor forward(const Tensor& x) override;  // x [N, in] -> [N, out]
  Tensor forward_then_relu(const Tensor& x) override;
  std::string describe() const override;
  Tensor& weight() { return param(0); }  // [out, in]

 private:
  int64_t in_, out_;
  bool bias_;
};

class Conv2d final : public Module {
 public:
  Conv2d(int64_t in_channels, int64_t out_channels, int64_t kernel, int64_t stride = 1,
         int64_t padding = 0, bool bias = true, TensorOptions options = {});
  Tensor forward(const Tensor& x) override;
  Tensor forward_then_relu(const Tensor& x) override;
  std::string describe() const override;

 private:
  int64_t in_, out_, kernel_, stride_, padding_;
  bool bias_;
};

class ReLU final : public Module {
 public:
  Tensor forward(const Tensor& x) override;
  std::string describe() const override { return "ReLU"; }
};

class MaxPool2d final : public Module {
 public:
  explicit MaxPool2d(int64_t kernel, int64_t stride = 0) : kernel_(kernel), stride_(stride) {}
  Tensor forward(const Tensor& x) override;
  std::string describe() const override;

 private:
  int64_t kernel_, stride_;
};

class Flatten final : public Module {
 public:
  explicit Flatten(int64_t start_dim = 1) : start_(start_dim) {}
  Tensor forward(const Tensor& x) override { return x.flatten(start_, -1); }
  std::string describe() const override { return "Flatten"; }

 private:
  int64_t start_;
};

class Dropout final : public Module {
 public:
  explicit Dropout(double p = 0.5);
  Tensor forward(const Tensor& x) override;
  std::string describe() const override;

 private:
  double p_;
};

class Sequential final : public Module {
 public:
  Sequential() = default;
  explicit Sequential(std::vector<std::shared_ptr<Module>> layers);
  void push_back(std::shared_ptr<Module> layer);
  Tensor forward(const Tensor& x) override;
  std::string describe() const override;
  size_t size() const { return layers_.size(); }

 private:
  std::vector<std::shared_ptr<Module>> layers_;
};

}  // namespace leasehold::engine::nn
