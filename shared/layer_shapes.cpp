#include "shared/layer_shapes.h"

namespace leasehold {
namespace {

std::string where(size_t i, const proto::Layer& l) {
  return "model[" + std::to_string(i) + "] (" + proto::EnumNameLayerType(l.type()) + ")";
}

std::string shape_text(const std::vector<int64_t>& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

}  // namespace

std::vector<std::vector<int64_t>> infer_layer_shapes(
    const flatbuffers::Vector<flatbuffers::Offset<proto::Layer>>& layers,
    std::vector<int64_t> shape, std::vector<std::string>& problems) {
  std::vector<std::vector<int64_t>> out;
  // Set by a first Embedding: the model works on sequences [T, F].
  const proto::Layer* embedding = nullptr;
  for (size_t i = 0; i < layers.size(); ++i) {
    const proto::Layer& l = *layers.Get(static_cast<flatbuffers::uoffset_t>(i));
    auto fail = [&](const std::string& what) {
      problems.push_back(where(i, l) + ": " + what);
      return out;
    };
    switch (l.type()) {
      case proto::LayerType::Linear: {
        if (l.in() <= 0 || l.out() <= 0) return fail("in and out must be positive");
        const bool sequence = embedding && shape.size() == 2;
        if (shape.size() != 1 && !sequence) {
          return fail("needs flat input but gets " + shape_text(shape) +
                      " (add a Flatten layer before it)");
        }
        if (shape.back() != l.in()) {
          return fail("in is " + std::to_string(l.in()) + " but the previous layer produces " +
                      std::to_string(shape.back()) + " features");
        }
        if (l.tied()) {
          if (!embedding) return fail("tied: there is no Embedding (model[0]) to tie to");
          if (l.in() != embedding->out() || l.out() != embedding->in()) {
            return fail("tied: the Embedding's table is [" + std::to_string(embedding->in()) +
                        ", " + std::to_string(embedding->out()) + "], so a tied Linear is in " +
                        std::to_string(embedding->out()) + ", out " +
                        std::to_string(embedding->in()) + ", not in " + std::to_string(l.in()) +
                        ", out " + std::to_string(l.out()));
          }
        }
        shape.back() = l.out();
        break;
      }
      case proto::LayerType::Embedding: {
        if (l.in() <= 0 || l.out() <= 0) return fail("in (vocabulary) and out must be positive");
        if (l.context() < 0) return fail("context must not be negative");
        if (i != 0 || shape.size() != 1) {
          return fail("must be the first layer, on a text dataset's tokens [T] (gets " +
                      shape_text(shape) + ")");
        }
        if (l.context() > 0 && shape[0] > l.context()) {
          return fail("context " + std::to_string(l.context()) + " is shorter than the " +
                      std::to_string(shape[0]) + " tokens of a sample");
        }
        embedding = &l;
        shape = {shape[0], l.out()};
        break;
      }
      case proto::LayerType::TransformerBlock: {
        if (l.out() <= 0 || l.heads() <= 0 || l.out() % l.heads() != 0) {
          return fail("out (" + std::to_string(l.out()) + ") must be a positive multiple of heads (" +
                      std::to_string(l.heads()) + ")");
        }
        if (l.out() / l.heads() > 128) {
          return fail("heads of " + std::to_string(l.out() / l.heads()) +
                      " are over the 128 the attention kernel takes (use more heads)");
        }
        if (!(l.dropout() >= 0 && l.dropout() < 1)) return fail("dropout must be in [0, 1)");
        if (shape.size() != 2 || shape[1] != l.out()) {
          return fail("needs [tokens, " + std::to_string(l.out()) + "] but gets " +
                      shape_text(shape));
        }
        break;
      }
      case proto::LayerType::LayerNorm: {
        if (l.out() <= 0) return fail("out must be positive");
        if (shape.back() != l.out()) {
          return fail("out is " + std::to_string(l.out()) + " but the previous layer produces " +
                      shape_text(shape));
        }
        break;
      }
      case proto::LayerType::GELU:
        break;
      case proto::LayerType::Conv2d: {
        if (l.in() <= 0 || l.out() <= 0 || l.kernel() <= 0) {
          return fail("in, out and kernel must be positive");
        }
        int64_t stride = l.stride() ? l.stride() : 1;
        if (stride < 0 || l.padding() < 0) return fail("stride and padding must not be negative");
        if (shape.size() != 3) return fail("needs [C, H, W] input but gets " + shape_text(shape));
        if (shape[0] != l.in()) {
          return fail("in is " + std::to_string(l.in()) + " channels but the input has " +
                      std::to_string(shape[0]));
        }
        int64_t h = (shape[1] + 2 * l.padding() - l.kernel()) / stride + 1;
        int64_t w = (shape[2] + 2 * l.padding() - l.kernel()) / stride + 1;
        if (shape[1] + 2 * l.padding() < l.kernel() || shape[2] + 2 * l.padding() < l.kernel()) {
          return fail("kernel " + std::to_string(l.kernel()) + " is larger than the input " +
                      shape_text(shape));
        }
        shape = {l.out(), h, w};
        break;
      }
      case proto::LayerType::MaxPool2d: {
        int64_t k = l.kernel(), stride = l.stride() ? l.stride() : k;
        if (k <= 0 || stride <= 0) return fail("kernel must be positive");
        if (shape.size() != 3) return fail("needs [C, H, W] input but gets " + shape_text(shape));
        if (shape[1] < k || shape[2] < k) {
          return fail("window " + std::to_string(k) + " is larger than the input " +
                      shape_text(shape));
        }
        shape = {shape[0], (shape[1] - k) / stride + 1, (shape[2] - k) / stride + 1};
        break;
      }
      case proto::LayerType::Flatten: {
        int64_t n = 1;
        for (int64_t d : shape) n *= d;
        shape = {n};
        break;
      }
      case proto::LayerType::ReLU:
        break;
      case proto::LayerType::Dropout:
        if (!(l.p() >= 0 && l.p() < 1)) return fail("p must be in [0, 1)");
        break;
      default:
        return fail("unknown layer type");
    }
    out.push_back(shape);
  }
  return out;
}

}  // namespace leasehold
