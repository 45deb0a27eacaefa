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
  for (size_t i = 0; i < layers.size(); ++i) {
    const proto::Layer& l = *layers.Get(static_cast<flatbuffers::uoffset_t>(i));
    auto fail = [&](const std::string& what) {
      problems.push_back(where(i, l) + ": " + what);
      return out;
    };
    switch (l.type()) {
      case proto::LayerType::Linear: {
        if (l.in() <= 0 || l.out() <= 0) return fail("in and out must be positive");
        if (shape.size() != 1) {
          return fail("needs flat input but gets " + shape_text(shape) +
                      " (add a Flatten layer before it)");
        }
        if (shape[0] != l.in()) {
          return fail("in is " + std::to_string(l.in()) + " but the previous layer produces " +
                      std::to_string(shape[0]) + " features");
        }
        shape = {l.out()};
        break;
      }
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
