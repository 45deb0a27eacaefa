#include "agent/model_builder.h"

#include <stdexcept>

namespace leasehold {

std::shared_ptr<engine::nn::Sequential> build_model(
    const flatbuffers::Vector<flatbuffers::Offset<proto::Layer>>& layers,
    engine::TensorOptions options) {
  namespace nn = engine::nn;
  auto model = std::make_shared<nn::Sequential>();
  for (const proto::Layer* l : layers) {
    switch (l->type()) {
      case proto::LayerType::Linear:
        model->push_back(std::make_shared<nn::Linear>(l->in(), l->out(), true, options));
        break;
      case proto::LayerType::Conv2d:
        model->push_back(std::make_shared<nn::Conv2d>(l->in(), l->out(), l->kernel(),
                                                      l->stride() ? l->stride() : 1, l->padding(),
                                                      true, options));
        break;
      case proto::LayerType::MaxPool2d:
        model->push_back(std::make_shared<nn::MaxPool2d>(l->kernel(), l->stride()));
        break;
      case proto::LayerType::Flatten:
        model->push_back(std::make_shared<nn::Flatten>(1));
        break;
      case proto::LayerType::ReLU:
        model->push_back(std::make_shared<nn::ReLU>());
        break;
      case proto::LayerType::Dropout:
        model->push_back(std::make_shared<nn::Dropout>(l->p()));
        break;
      default:
        throw std::invalid_argument("unknown layer type");
    }
  }
  return model;
}

}  // namespace leasehold
