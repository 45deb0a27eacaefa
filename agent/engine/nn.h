// Neural-network modules with PyTorch's default initialisations. Parameters
// are leaf tensors that require grad, enumerable by dotted name
// ("0.weight" for the first child of a Sequential).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "agent/engine/host_offload.h"
#include "agent/engine/recompute.h"
#include "agent/engine/tensor.h"

namespace leasehold::engine {
struct KeptAttention;  // ops.h
}  // namespace leasehold::engine

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
  // forward(x), its output kept in autocast's lower precision where the
  // layer can write it so (a product's or a norm's: ops.h, ProductOut);
  // forward(x) for the others and without autocast. Sequential calls it
  // for a layer followed by one that reads its input only through a
  // product (below): that product would round it to bfloat16 anyway, so
  // the forward's bits stay the same and the float32 output is never
  // written (the GPT's final norm before its output head: a forward's peak
  // where memory is short). The input's gradient then comes back in
  // bfloat16, as PyTorch's autocast rounds it before the product.
  virtual Tensor forward_lower_precision(const Tensor& x) { return forward(x); }
  // Whether forward reads its input only as a product's operand (a linear
  // layer's, an output head's), so a bfloat16 input is read as it is.
  virtual bool reads_input_through_product() const { return false; }
  // "Linear(784 -> 256)" etc.
  virtual std::string describe() const = 0;

  NamedTensors named_parameters() const;
  std::vector<Tensor> parameters() const;
  // The parameters that its products multiply (linear layers' weights and
  // biases, a tied output's table), its children's included: those a step
  // under autocast copies to bfloat16 once (autocast.h: AutocastWeights).
  virtual std::vector<Tensor> product_parameters() const;
  int64_t parameter_count() const;
  // Training mode (dropout active) is the default.
  void train(bool on = true);
  void eval() { train(false); }
  bool is_training() const { return training_; }
  // Moves parameters to `device` (they stay leaves that require grad).
  void to(Device device);
  // The modules it is made of, in order.
  const std::vector<std::shared_ptr<Module>>& children() const { return children_; }

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
  // x [..., in] -> [..., out] (leading dimensions flattened for one GEMM).
  Tensor forward(const Tensor& x) override;
  Tensor forward_then_relu(const Tensor& x) override;
  // forward(x), kept in bfloat16 under autocast for a product that reads
  // it next or a branch that add_dropout adds to the residual stream
  // (ops.h: ProductOut); float32 otherwise.
  Tensor forward_lower_precision(const Tensor& x) override;
  bool reads_input_through_product() const override { return true; }
  // gelu(forward(x)), fused under autocast (ops.h: linear_gelu).
  Tensor forward_then_gelu(const Tensor& x);
  std::string describe() const override;
  std::vector<Tensor> product_parameters() const override { return parameters(); }
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

// Transformer layers (GPT-2's, as nanoGPT writes them). Their weights start
// as GPT-2's: normal(0, 0.02), biases zero, norm gains one.

// Token embedding [vocab, dim] plus, when context > 0, a learned position
// embedding [context, dim]: int64 tokens [B, T] (T <= context) -> [B, T, dim].
class Embedding final : public Module {
 public:
  Embedding(int64_t vocab, int64_t dim, int64_t context = 0, TensorOptions options = {});
  Tensor forward(const Tensor& tokens) override;
  std::string describe() const override;
  const Tensor& weight() const { return param(0); }
  int64_t vocab() const { return vocab_; }
  int64_t dim() const { return dim_; }

 private:
  int64_t vocab_, dim_, context_;
};

// The output projection that reuses an embedding's table as its weight
// (weight tying): [..., dim] -> [..., vocab] logits, no bias. It has no
// parameters of its own, so the table is trained (and checkpointed) once.
class TiedOutput final : public Module {
 public:
  explicit TiedOutput(std::shared_ptr<Embedding> embedding);
  Tensor forward(const Tensor& x) override;
  std::string describe() const override;
  std::vector<Tensor> product_parameters() const override { return {embedding_->weight()}; }
  bool reads_input_through_product() const override { return true; }

 private:
  std::shared_ptr<Embedding> embedding_;
};

class LayerNorm final : public Module {
 public:
  explicit LayerNorm(int64_t dim, double eps = 1e-5, TensorOptions options = {});
  Tensor forward(const Tensor& x) override;  // over the last dimension
  // forward, in bfloat16 under autocast (ops.h: layer_norm), for an output
  // that only a product reads.
  Tensor forward_lower_precision(const Tensor& x) override;
  std::string describe() const override;

 private:
  int64_t dim_;
  double eps_;
};

class GELU final : public Module {
 public:
  Tensor forward(const Tensor& x) override;
  std::string describe() const override { return "GELU"; }
};

// A pre-norm GPT block on [B, T, dim]:
//   x + dropout(proj(attention(ln1(x)))), then + dropout(fc2(gelu(fc1(ln2(x))))),
// attention causal over `heads` heads (fused kernel, no dropout inside it),
// the MLP 4 × dim wide. The two output projections start at normal(0,
// 0.02 / sqrt(2 × layers)) (GPT-2's scaling by depth).
class TransformerBlock final : public Module {
 public:
  TransformerBlock(int64_t dim, int64_t heads, double dropout, int64_t layers,
                   TensorOptions options = {});
  Tensor forward(const Tensor& x) override;
  std::string describe() const override;
  // What training keeps of the block for backward (recompute.h). Under
  // autocast the MLP holds more than half of a block's activations (its
  // layer norm's output, fc1's output and the GELU's) and costs a third of
  // its forward, so recomputing it frees about twice the bytes per
  // microsecond that recomputing the whole block does. The block's two
  // halves recomputed apart cost what the whole block does and keep one
  // input more (the residual stream between them), but backward then
  // holds one half's activations at a time instead of both: the least
  // memory a recomputed block's backward needs, where a budget is so tight
  // that the whole block's own activations would spill. Between the MLP
  // and the whole block: the whole block but its attention kernel, whose
  // output it keeps (ops.h: KeptAttention): under autocast a third of
  // what a block recomputing its MLP keeps, for three fifths of its
  // attention half's recompute. The whole block in halves keeps only the
  // block's input, as the whole block does, and holds one half's
  // activations at a time in backward, as the halves do, for one more
  // attention half's forward (its backward makes the MLP's input again
  // first, and records the MLP without running it): where the halves'
  // second input would cross the host link (host_offload.h), about
  // 0.46 ms for a GPT block's, against about 120 us.
  enum class Recompute {
    None,               // every activation kept (the default)
    Mlp,                // the MLP keeps only its input and runs again in backward
    BlockButAttention,  // the block keeps its input and attention's output; the rest runs again
    Halves,             // each half (attention, MLP) keeps only its input and runs again
    Block,              // the whole block keeps only its input and runs again
    BlockInHalves,      // the whole block keeps only its input; backward runs it in halves
  };
  void set_recompute(Recompute r) { recompute_ = r; }
  Recompute recompute() const { return recompute_; }
  // Which inputs its recomputed segments keep wait for backward in host
  // memory instead of on the device (host_offload.h): for a budget that
  // every block recomputing whole does not meet, bytes moved over the
  // host link while the step's kernels run, without recomputing more.
  // Nothing changes while the block recomputes nothing.
  enum class Offload {
    None,
    Input,   // the block's input (in halves, its attention half's)
    Inputs,  // with its MLP's input (where it recomputes its MLP apart)
  };
  void set_offload(Offload o) { offload_ = o; }
  Offload offload() const { return offload_; }
  // The host memory its inputs' slots hold (0 where none went there: none
  // planned, no room for them, host_offload.h: stash, or no forward has
  // run since they were planned), and whether a slot ever had no room.
  uint64_t offload_host_bytes() const {
    return input_slot_.host_bytes() + mlp_input_slot_.host_bytes();
  }
  bool offload_short_of_memory() const {
    return input_slot_.short_of_memory() || mlp_input_slot_.short_of_memory();
  }
  // Over how many slices of the batch, one at a time, the block's MLP runs
  // again in its own backward where it runs again (every level but None;
  // recompute.h): with 4, a quarter of its activations (the GPT's: three
  // of 48 MiB at once) live at a time, for products of a quarter of the
  // rows. 1 (the default): the whole batch at once, the gradients of a
  // block that keeps everything, bit for bit; with more, their weights'
  // gradients are sums over the slices. REQUIRES: parts >= 1.
  void set_mlp_parts(int64_t parts);
  int64_t mlp_parts() const { return mlp_parts_; }

 private:
  // The block's parts; `replay`: run again in backward as a segment
  // (recompute.h), whose last operators' outputs are never read.
  // `kept` (may be null): the attention's output kept for the run again
  // (Recompute::BlockButAttention).
  // `mlp_out` (may be null; a whole block recomputed): what the MLP gave
  // in the first run, which the run again records without running it
  // where the MLP runs in its own backward (Recompute::BlockInHalves, or
  // in slices).
  Tensor body(const Tensor& x, bool replay, KeptAttention* kept = nullptr,
              std::optional<SegmentOutput>* mlp_out = nullptr);
  // x + dropout(proj(attention(ln1(x))))
  Tensor attention_half(const Tensor& x, bool replay, KeptAttention* kept = nullptr);
  Tensor mlp(const Tensor& h, bool replay);
  int64_t dim_, heads_;
  double p_;
  Recompute recompute_ = Recompute::None;
  Offload offload_ = Offload::None;
  int64_t mlp_parts_ = 1;
  // Host memory for the block's (or its attention half's) input and its
  // MLP's, as offload() says (null: kept on the device).
  OffloadSlot* input_slot() { return offload_ != Offload::None ? &input_slot_ : nullptr; }
  OffloadSlot* mlp_input_slot() { return offload_ == Offload::Inputs ? &mlp_input_slot_ : nullptr; }
  OffloadSlot input_slot_, mlp_input_slot_;
  std::shared_ptr<LayerNorm> ln1_, ln2_;
  std::shared_ptr<Linear> qkv_, proj_, fc1_, fc2_;
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
