#include "agent/model_builder.h"

#include <stdexcept>

namespace leasehold {

std::shared_ptr<engine::nn::Sequential> build_model(
    const flatbuffers::Vector<flatbuffers::Offset<proto::Layer>>& layers,
    engine::TensorOptions options) {
  namespace nn = engine::nn;
  auto model = std::make_shared<nn::Sequential>();
  std::shared_ptr<nn::Embedding> embedding;  // what a tied Linear reuses
  int64_t blocks = 0;  // (the residual projections' initial scale)
  for (const proto::Layer* l : layers) blocks += l->type() == proto::LayerType::TransformerBlock;
  for (const proto::Layer* l : layers) {
    switch (l->type()) {
      case proto::LayerType::Linear:
        if (l->tied()) {
          if (!embedding) throw std::invalid_argument("a tied Linear needs an Embedding first");
          model->push_back(std::make_shared<nn::TiedOutput>(embedding));
        } else {
          model->push_back(std::make_shared<nn::Linear>(l->in(), l->out(), true, options));
        }
        break;
      case proto::LayerType::Embedding:
        embedding = std::make_shared<nn::Embedding>(l->in(), l->out(), l->context(), options);
        model->push_back(embedding);
        break;
      case proto::LayerType::TransformerBlock:
        model->push_back(std::make_shared<nn::TransformerBlock>(l->out(), l->heads(), l->dropout(),
                                                                blocks, options));
        break;
      case proto::LayerType::LayerNorm:
        model->push_back(std::make_shared<nn::LayerNorm>(l->out(), 1e-5, options));
        break;
      case proto::LayerType::GELU:
        model->push_back(std::make_shared<nn::GELU>());
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
