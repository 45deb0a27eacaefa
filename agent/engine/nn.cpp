#include "agent/engine/nn.h"

#include <cmath>
#include <sstream>
#include <stdexcept>

#include "agent/engine/autocast.h"
#include "agent/engine/autograd.h"
#include "agent/engine/ops.h"
#include "agent/engine/recompute.h"

namespace leasehold::engine::nn {
namespace {

// PyTorch's default for Linear and Conv2d: kaiming_uniform_(a=sqrt(5)) on
// the weight, which is U(-1/sqrt(fan_in), 1/sqrt(fan_in)), and the same bound
// for the bias.
Tensor uniform_init(const Shape& shape, int64_t fan_in, TensorOptions options) {
  double bound = 1.0 / std::sqrt(static_cast<double>(std::max<int64_t>(fan_in, 1)));
  return rand(shape, options, -bound, bound);
}

// GPT-2's initialisation: weights normal(0, std), biases zero.
void init_gpt(Module& m, double std) {
  NoGradGuard no_grad;
  for (auto& [name, t] : m.named_parameters()) {
    if (t.dim() >= 2) {
      t.copy_(randn(t.sizes(), t.options(), 0, std));
    } else {
      t.fill_(0);
    }
  }
}

// [..., in] as [N, in] for one GEMM (a view when the layout allows).
Tensor rows_of(const Tensor& x, int64_t in) { return x.dim() == 2 ? x : x.reshape({-1, in}); }
Tensor unrows(const Tensor& y, const Tensor& x) {
  if (x.dim() == 2) return y;
  Shape s(x.sizes().begin(), x.sizes().end() - 1);
  s.push_back(y.size(1));
  return y.reshape(s);
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

std::vector<Tensor> Module::product_parameters() const {
  std::vector<Tensor> out;
  for (const auto& child : children_) {
    for (Tensor& t : child->product_parameters()) out.push_back(std::move(t));
  }
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
  if (x.dim() < 2 || x.size(-1) != in_) {
    throw std::invalid_argument("Linear(" + std::to_string(in_) + " -> " + std::to_string(out_) +
                                "): input " + x.shape_str() + " is not [..., " +
                                std::to_string(in_) + "]");
  }
  return unrows(linear(rows_of(x, in_), param(0), bias_ ? param(1) : Tensor()), x);
}

Tensor Linear::forward_then_relu(const Tensor& x) {
  if (x.dim() < 2 || x.size(-1) != in_) return relu(forward(x));  // forward names the problem
  return unrows(linear(rows_of(x, in_), param(0), bias_ ? param(1) : Tensor(), /*then_relu=*/true),
                x);
}

Tensor Linear::forward_lower_precision(const Tensor& x) {
  if (x.dim() < 2 || x.size(-1) != in_) return forward(x);  // forward names the problem
  return unrows(linear(rows_of(x, in_), param(0), bias_ ? param(1) : Tensor(), false,
                       ProductOut::LowerPrecision),
                x);
}

Tensor Linear::forward_then_gelu(const Tensor& x) {
  if (x.dim() < 2 || x.size(-1) != in_) return gelu(forward(x));  // forward names the problem
  return unrows(linear_gelu(rows_of(x, in_), param(0), bias_ ? param(1) : Tensor()), x);
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

Embedding::Embedding(int64_t vocab, int64_t dim, int64_t context, TensorOptions options)
    : vocab_(vocab), dim_(dim), context_(context) {
  if (vocab <= 0 || dim <= 0 || context < 0) {
    throw std::invalid_argument("Embedding: vocabulary and width must be positive and the "
                                "context non-negative");
  }
  add_parameter("weight", randn({vocab, dim}, options, 0, 0.02));
  if (context > 0) add_parameter("position", randn({context, dim}, options, 0, 0.02));
}

Tensor Embedding::forward(const Tensor& tokens) {
  Tensor h = embedding(param(0), tokens);
  if (context_ == 0) return h;
  const int64_t t = tokens.dim() ? tokens.size(-1) : 1;
  if (tokens.dim() < 1 || t > context_) {
    throw std::invalid_argument("Embedding: " + tokens.shape_str() + " tokens, at most " +
                                std::to_string(context_) + " a sequence");
  }
  return add(h, param(1).narrow(0, 0, t));
}

std::string Embedding::describe() const {
  return "Embedding(" + std::to_string(vocab_) + " -> " + std::to_string(dim_) +
         (context_ ? ", context " + std::to_string(context_) : std::string()) + ")";
}

TiedOutput::TiedOutput(std::shared_ptr<Embedding> embedding) : embedding_(std::move(embedding)) {
  if (!embedding_) throw std::invalid_argument("TiedOutput: no embedding to tie to");
}

Tensor TiedOutput::forward(const Tensor& x) {
  const int64_t dim = embedding_->dim();
  if (x.dim() < 2 || x.size(-1) != dim) {
    throw std::invalid_argument("TiedOutput(" + std::to_string(dim) + " -> " +
                                std::to_string(embedding_->vocab()) + "): input " +
                                x.shape_str() + " is not [..., " + std::to_string(dim) + "]");
  }
  return unrows(linear(rows_of(x, dim), embedding_->weight(), Tensor()), x);
}

std::string TiedOutput::describe() const {
  return "Linear(" + std::to_string(embedding_->dim()) + " -> " +
         std::to_string(embedding_->vocab()) + ", tied to the embedding)";
}

LayerNorm::LayerNorm(int64_t dim, double eps, TensorOptions options) : dim_(dim), eps_(eps) {
  if (dim <= 0 || !(eps > 0)) {
    throw std::invalid_argument("LayerNorm: width and eps must be positive");
  }
  add_parameter("weight", ones({dim}, options));
  add_parameter("bias", zeros({dim}, options));
}

Tensor LayerNorm::forward(const Tensor& x) { return layer_norm(x, param(0), param(1), eps_); }
Tensor LayerNorm::forward_lower_precision(const Tensor& x) {
  return layer_norm(x, param(0), param(1), eps_, ProductOut::LowerPrecision);
}
std::string LayerNorm::describe() const { return "LayerNorm(" + std::to_string(dim_) + ")"; }

Tensor GELU::forward(const Tensor& x) { return gelu(x); }

TransformerBlock::TransformerBlock(int64_t dim, int64_t heads, double p, int64_t layers,
                                   TensorOptions options)
    : dim_(dim), heads_(heads), p_(p) {
  if (dim <= 0 || heads <= 0 || dim % heads != 0) {
    throw std::invalid_argument("TransformerBlock: width " + std::to_string(dim) +
                                " must be a positive multiple of the " + std::to_string(heads) +
                                " heads");
  }
  if (p < 0 || p >= 1) throw std::invalid_argument("TransformerBlock: dropout must be in [0, 1)");
  if (layers <= 0) throw std::invalid_argument("TransformerBlock: layers must be positive");
  ln1_ = std::make_shared<LayerNorm>(dim, 1e-5, options);
  qkv_ = std::make_shared<Linear>(dim, 3 * dim, true, options);
  proj_ = std::make_shared<Linear>(dim, dim, true, options);
  ln2_ = std::make_shared<LayerNorm>(dim, 1e-5, options);
  fc1_ = std::make_shared<Linear>(dim, 4 * dim, true, options);
  fc2_ = std::make_shared<Linear>(4 * dim, dim, true, options);
  for (auto& m : {ln1_, ln2_}) add_child(m);
  for (auto& m : {qkv_, proj_, fc1_, fc2_}) {
    add_child(m);
    init_gpt(*m, 0.02);
  }
  const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(layers));
  init_gpt(*proj_, residual_std);
  init_gpt(*fc2_, residual_std);
}

Tensor TransformerBlock::forward(const Tensor& x) {
  if (x.dim() != 3 || x.size(2) != dim_) {
    throw std::invalid_argument("TransformerBlock(" + std::to_string(dim_) + "): input " +
                                x.shape_str() + " is not [batch, tokens, " +
                                std::to_string(dim_) + "]");
  }
  Tensor out;
  // (A whole block's first run says what its MLP gives, for a run again
  // that records the MLP without running it.)
  auto mlp_out = std::make_shared<std::optional<SegmentOutput>>();
  if ((recompute_ == Recompute::Block || recompute_ == Recompute::BlockInHalves) &&
      is_training()) {
    out = recompute_in_backward(
        [this, mlp_out](const Tensor& in, bool replay) {
          return body(in, replay, nullptr, mlp_out.get());
        },
        x, input_slot(), 1, product_parameters());
  } else if (recompute_ == Recompute::BlockButAttention && is_training()) {
    // (The first run fills `kept`, the run again in backward empties it.)
    auto kept = std::make_shared<KeptAttention>();
    out = recompute_in_backward(
        [this, kept, mlp_out](const Tensor& in, bool replay) {
          return body(in, replay, kept.get(), mlp_out.get());
        },
        x, input_slot(), 1, product_parameters());
  } else {
    out = body(x, false);
  }
  // A block that runs again in backward makes its own weights' copies
  // there (recompute.h): the step's go now, not at the forward pass's end
  // (the GPT's: 3.4 MiB a block), where a step that recomputes has its
  // peak. (A block recomputing its MLP only: its attention's products
  // keep theirs.)
  if (is_training() && grad_enabled() && recompute_ != Recompute::None) {
    if (AutocastWeights* copies = autocast_weights()) copies->release(product_parameters());
  }
  // (Inputs stashed kOffloadReleaseAfterBlocks blocks ago leave the
  // device: host_offload.h.)
  if (is_training()) offload_progress();
  return out;
}

namespace {

// The product parameters of `modules`: a segment's weights (recompute.h),
// whose bfloat16 copies its backward makes once.
std::vector<Tensor> weights_of(std::initializer_list<const Module*> modules) {
  std::vector<Tensor> params;
  for (const Module* m : modules) {
    for (Tensor& t : m->product_parameters()) params.push_back(std::move(t));
  }
  return params;
}

}  // namespace

Tensor TransformerBlock::mlp(const Tensor& h, bool replay) {
  // (Under autocast the norm writes bfloat16 for fc1 to multiply as it is,
  // the GELU is fc1's epilogue, its bfloat16 output is what fc2 multiplies,
  // and fc2's output stays bfloat16 until its dropout adds it to the
  // float32 residual stream, as PyTorch's autocast keeps it.)
  const Tensor a = fc1_->forward_then_gelu(ln2_->forward_lower_precision(h));
  // (Run again in backward, fc2's product is made for its graph only.)
  OutputsUnreadGuard tail(replay);
  return fc2_->forward_lower_precision(a);
}

Tensor TransformerBlock::attention_half(const Tensor& x, bool replay, KeptAttention* kept) {
  // q, k and v of every head read in place from the projection [B, T, 3 × dim]
  // (as [B, T, 3, heads, dim / heads]), the heads merged as they are written.
  // Under autocast the norm writes bfloat16 for the projection, the
  // projection stays in bfloat16 for the attention's products, so does the
  // attention's output for proj's, and proj's for its dropout's addition to
  // the float32 residual stream (whose backward writes proj's gradient in
  // bfloat16, ready for its products).
  const Tensor qkv = qkv_->forward_lower_precision(ln1_->forward_lower_precision(x));
  Tensor merged = kept ? self_attention(qkv, heads_, /*causal=*/true, *kept)
                       : self_attention(qkv, heads_, /*causal=*/true);
  // (Run again in backward, proj's product and the addition are made for
  // their graph only.)
  OutputsUnreadGuard tail(replay);
  return add_dropout(x, proj_->forward_lower_precision(merged), p_, is_training());
}

Tensor TransformerBlock::body(const Tensor& x, bool replay, KeptAttention* kept,
                              std::optional<SegmentOutput>* mlp_out) {
  // (Within a whole block's recompute the halves run plainly: the block
  // keeps nothing but its input, and the attention's output for
  // Recompute::BlockButAttention. Run again so, the MLP's output feeds only
  // the last addition, whose output is never read: both are made for
  // their graph only. Recompute::BlockInHalves: the halves recompute
  // apart within the block's run again, from inputs on the device.)
  const bool training = is_training();
  const bool halves =
      training && (recompute_ == Recompute::Halves || recompute_ == Recompute::BlockInHalves);
  // (Run again within the whole block, the MLP only roots its graph where
  // it runs in its own backward, in halves apart from the attention's or
  // in slices of the batch: its output feeds the unread addition alone.)
  const bool mlp_recorded = (halves || mlp_parts_ > 1) && replay && mlp_out && *mlp_out;
  const bool own_slots = recompute_ == Recompute::Halves || recompute_ == Recompute::Mlp;
  const Segment attention_segment = [this](const Tensor& in, bool again) {
    return attention_half(in, again);
  };
  Tensor h = halves ? recompute_in_backward(attention_segment, x,
                                            own_slots ? input_slot() : nullptr, 1,
                                            weights_of({qkv_.get(), proj_.get()}))
                    : attention_half(x, false, kept);
  Tensor m;
  const Segment mlp_segment = [this](const Tensor& in, bool again) { return mlp(in, again); };
  if (mlp_recorded) {
    m = record_for_backward(mlp_segment, h, **mlp_out, mlp_parts_,
                            weights_of({fc1_.get(), fc2_.get()}));
  } else if (halves || (training && recompute_ == Recompute::Mlp)) {
    m = recompute_in_backward(mlp_segment, h, own_slots ? mlp_input_slot() : nullptr,
                              mlp_parts_, weights_of({fc1_.get(), fc2_.get()}));
  } else {
    m = mlp(h, replay);
  }
  if (mlp_out && !replay) *mlp_out = SegmentOutput{m.sizes(), m.options()};
  OutputsUnreadGuard tail(replay);
  return add_dropout(h, m, p_, training);
}

void TransformerBlock::set_mlp_parts(int64_t parts) {
  if (parts < 1) throw std::invalid_argument("TransformerBlock: MLP parts must be at least 1");
  mlp_parts_ = parts;
}

std::string TransformerBlock::describe() const {
  std::ostringstream os;
  os << "TransformerBlock(" << dim_ << ", " << heads_ << " heads, dropout " << p_ << ")";
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
    const Module* next = i + 1 < layers_.size() ? layers_[i + 1].get() : nullptr;
    if (dynamic_cast<const ReLU*>(next)) {
      h = layers_[i]->forward_then_relu(h);
      ++i;
    } else if (next && next->reads_input_through_product()) {
      h = layers_[i]->forward_lower_precision(h);
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
