#include "agent/engine/nn.h"

#include <cmath>
#include <sstream>
#include <stdexcept>

#include "agent/engine/autograd.h"
#include "agent/engine/ops.h"

namespace leasehold::engine::nn {
namespace {

// PyTorch's default for Linear and Conv2d: kaiming_uniform_(a=sqrt(5)) on
// the weight, which is U(-1/sqrt(fan_in), 1/sqrt(fan_in)), and the same bound
// for the bias.
Tensor uniform_init(const Shape& shape, int64_t fan_in, TensorOptions options) {
  double bound = 1.0 / std::sqrt(static_cast<double>(std::max<int64_t>(fan_in, 1)));
  return rand(shape, options, -bound, bound);
}

}  // namespace

Tensor Module::forward_then_relu(const Tensor& x) { return relu(forward(x)); }

NamedTensors Module::named_parameters() const {
  NamedTensors out = params_;
  for (size_t i = 0; i < children_.size(); ++i) {
    for (auto& [name, t] : children_[i]->named_parameters()) {
      out.emplace_back(std::to_string(i) + "." + name, t);
    }
  }
  return out;
}

std::vector<Tensor> Module::parameters() const {
  std::vector<Tensor> out;
  for (auto& [name, t] : named_parameters()) out.push_back(t);
  return out;
}

int64_t Module::parameter_count() const {
  int64_t n = 0;
  for (auto& t : parameters()) n += t.numel();
  return n;
}

void Module::train(bool on) {
  training_ = on;
  for (auto& c : children_) c->train(on);
}

void Module::to(Device device) {
  for (auto& [name, t] : params_) {
    if (t.device() == device) continue;
    Tensor moved = t.detach().to(device);
    moved.set_requires_grad(true);
    t = moved;
  }
  for (auto& c : children_) c->to(device);
}

Tensor& Module::add_parameter(const std::string& name, Tensor t) {
  t.set_requires_grad(true);
  params_.emplace_back(name, std::move(t));
  return params_.back().second;
}

void Module::add_child(std::shared_ptr<Module> child) {
  if (!child) throw std::invalid_argument("Sequential: null layer");
  children_.push_back(std::move(child));
}

Linear::Linear(int64_t in, int64_t out, bool bias, TensorOptions options)
    : in_(in), out_(out), bias_(bias) {
  if (in <= 0 || out <= 0) {
    throw std::invalid_argument("Linear: features must be positive, got " + std::to_string(in) +
                                " -> " + std::to_string(out));
  }
  add_parameter("weight", uniform_init({out, in}, in, options));
  if (bias) add_parameter("bias", uniform_init({out}, in, options));
}

Tensor Linear::forward(const Tensor& x) {
  if (x.dim() != 2 || x.size(1) != in_) {
    throw std::invalid_argument("Linear(" + std::to_string(in_) + " -> " + std::to_string(out_) +
                                "): input " + x.shape_str() + " is not [N, " +
                                std::to_string(in_) + "]");
  }
  return linear(x, param(0), bias_ ? param(1) : Tensor());
}

Tensor Linear::forward_then_relu(const Tensor& x) {
  if (x.dim() != 2 || x.size(1) != in_) return relu(forward(x));  // forward names the problem
  return linear(x, param(0), bias_ ? param(1) : Tensor(), /*then_relu=*/true);
}

std::string Linear::describe() const {
  return "Linear(" + std::to_string(in_) + " -> " + std::to_string(out_) + ")";
}

Conv2d::Conv2d(int64_t in, int64_t out, int64_t kernel, int64_t stride, int64_t padding,
               bool bias, TensorOptions options)
    : in_(in), out_(out), kernel_(kernel), stride_(stride), padding_(padding), bias_(bias) {
  if (in <= 0 || out <= 0 || kernel <= 0 || stride <= 0 || padding < 0) {
    throw std::invalid_argument("Conv2d: channels, kernel and stride must be positive and "
                                "padding non-negative");
  }
  int64_t fan_in = in * kernel * kernel;
  add_parameter("weight", uniform_init({out, in, kernel, kernel}, fan_in, options));
  if (bias) add_parameter("bias", uniform_init({out}, fan_in, options));
}

Tensor Conv2d::forward(const Tensor& x) {
  return conv2d(x, param(0), bias_ ? param(1) : Tensor(), stride_, padding_);
}

Tensor Conv2d::forward_then_relu(const Tensor& x) {
  return conv2d(x, param(0), bias_ ? param(1) : Tensor(), stride_, padding_, /*then_relu=*/true);
}

std::string Conv2d::describe() const {
  return "Conv2d(" + std::to_string(in_) + " -> " + std::to_string(out_) + ", " +
         std::to_string(kernel_) + "x" + std::to_string(kernel_) + ", stride " +
         std::to_string(stride_) + ", padding " + std::to_string(padding_) + ")";
}

Tensor ReLU::forward(const Tensor& x) { return relu(x); }

Tensor MaxPool2d::forward(const Tensor& x) { return max_pool2d(x, kernel_, stride_); }
std::string MaxPool2d::describe() const { return "MaxPool2d(" + std::to_string(kernel_) + ")"; }

Dropout::Dropout(double p) : p_(p) {
  if (p < 0 || p >= 1) throw std::invalid_argument("Dropout: p must be in [0, 1)");
}
Tensor Dropout::forward(const Tensor& x) { return dropout(x, p_, is_training()); }
std::string Dropout::describe() const {
  std::ostringstream os;
  os << "Dropout(" << p_ << ")";
  return os.str();
}

Sequential::Sequential(std::vector<std::shared_ptr<Module>> layers) {
  for (auto& l : layers) push_back(std::move(l));
}

void Sequential::push_back(std::shared_ptr<Module> layer) {
  add_child(layer);
  layers_.push_back(std::move(layer));
}

Tensor Sequential::forward(const Tensor& x) {
  Tensor h = x;
  for (size_t i = 0; i < layers_.size(); ++i) {
    if (i + 1 < layers_.size() && dynamic_cast<const ReLU*>(layers_[i + 1].get())) {
      h = layers_[i]->forward_then_relu(h);
      ++i;
    } else {
      h = layers_[i]->forward(h);
    }
  }
  return h;
}

std::string Sequential::describe() const {
  std::string s = "Sequential(";
  for (size_t i = 0; i < layers_.size(); ++i) s += (i ? ", " : "") + layers_[i]->describe();
  return s + ")";
}

}  // namespace leasehold::engine::nn
