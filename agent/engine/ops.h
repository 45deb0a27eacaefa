// Tensor operators, differentiable unless noted. Inputs must share device
// and dtype (no implicit promotion); elementwise operators broadcast like
// NumPy. Each throws std::invalid_argument naming the operator and the
// offending shapes, dtypes or devices.
#pragma once

#include <cstdint>
#include <optional>
#include <utility>

#include "agent/engine/autograd.h"
#include "agent/engine/tensor.h"

namespace leasehold::engine {

// Elementwise.
Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
Tensor div(const Tensor& a, const Tensor& b);
Tensor add(const Tensor& a, double s);
Tensor mul(const Tensor& a, double s);
Tensor neg(const Tensor& x);
Tensor exp(const Tensor& x);
Tensor log(const Tensor& x);
Tensor pow(const Tensor& x, double exponent);
Tensor sqrt(const Tensor& x);
Tensor abs(const Tensor& x);
Tensor relu(const Tensor& x);
Tensor sigmoid(const Tensor& x);
Tensor tanh(const Tensor& x);
// GELU in its tanh form (PyTorch's gelu(x, approximate="tanh"), GPT-2's).
Tensor gelu(const Tensor& x);
// Not differentiable: 1 where equal, else 0 (same dtype as the inputs).
Tensor eq(const Tensor& a, const Tensor& b);

inline Tensor operator+(const Tensor& a, const Tensor& b) { return add(a, b); }
inline Tensor operator-(const Tensor& a, const Tensor& b) { return sub(a, b); }
inline Tensor operator*(const Tensor& a, const Tensor& b) { return mul(a, b); }
inline Tensor operator/(const Tensor& a, const Tensor& b) { return div(a, b); }
inline Tensor operator-(const Tensor& x) { return neg(x); }
inline Tensor operator*(const Tensor& a, double s) { return mul(a, s); }
inline Tensor operator+(const Tensor& a, double s) { return add(a, s); }

// Matrix products: [m,k]x[k,n], [b,m,k]x[b,k,n] and [b,m,k]x[k,n]. float32
// is full precision unless set_allow_tf32(true).
Tensor matmul(const Tensor& a, const Tensor& b);
// A fully connected layer: x [N, in] · wᵀ (w [out, in]) + bias [out] (may
// be undefined), then a ReLU when `then_relu`. One GEMM reading w as
// stored; on CUDA the bias and the ReLU in one pass after it, and in
// backward the ReLU's mask and the bias gradient in one pass, then two GEMMs.
//
// Under bfloat16 autocast on CUDA the product runs in bfloat16 on tensor
// cores and x may already be bfloat16 (another product's output); the
// result is float32, or bfloat16 when `out` asks for the lower precision
// (for a result that only feeds another product, or a branch that
// add_dropout adds to a float32 residual stream; not with a ReLU, whose
// output is its backward's mask). A gradient has its tensor's type (a
// bfloat16 one read twice has its gradients summed in float32).
enum class ProductOut { Float32, LowerPrecision };
Tensor linear(const Tensor& x, const Tensor& w, const Tensor& bias, bool then_relu = false,
              ProductOut out = ProductOut::Float32);
// gelu(linear(x, w, bias)). Under bfloat16 autocast on CUDA the bias and
// GELU are the product's own epilogue (cuBLASLt's GELU_AUX_BIAS) and the
// result is bfloat16, as is the GELU input backward keeps: the MLP's
// [N, 4 × dim] activation is written once, in half the bytes.
Tensor linear_gelu(const Tensor& x, const Tensor& w, const Tensor& bias);

// Reductions over `dims` (empty: all dimensions).
Tensor sum(const Tensor& x, Shape dims = {}, bool keepdim = false);
Tensor mean(const Tensor& x, Shape dims = {}, bool keepdim = false);
// Maximum along `dim` and its first index (int64, not differentiable).
std::pair<Tensor, Tensor> max(const Tensor& x, int64_t dim, bool keepdim = false);
Tensor argmax(const Tensor& x, int64_t dim, bool keepdim = false);

Tensor softmax(const Tensor& x, int64_t dim);
Tensor log_softmax(const Tensor& x, int64_t dim);

// Losses (mean over the batch).
// logits [N, C], labels int64 [N] in [0, C); fused and numerically stable.
// A label outside [0, C) throws std::invalid_argument naming the count and
// one such label; on CUDA that means reading a count back from the device
// every call (waiting for it) unless a DeferredLabelCheck is active.
class DeferredLabelCheck {
 public:
  // Until destroyed, cross_entropy on `device` on this thread counts bad
  // labels where its kernel runs instead of reading them back at once. The
  // counter comes from the current allocator.
  explicit DeferredLabelCheck(Device device);
  ~DeferredLabelCheck();
  DeferredLabelCheck(const DeferredLabelCheck&) = delete;
  DeferredLabelCheck& operator=(const DeferredLabelCheck&) = delete;
  // Reads the count (waiting for the device) and throws cross_entropy's
  // error if any label was bad since the scope began.
  void check();
  // The active check for `device` on this thread, if any.
  static DeferredLabelCheck* current(Device device);
  // Where the kernel counts (two int64s on the device), for rows of `classes`.
  int64_t* slots(int64_t classes);

 private:
  Device device_;
  Tensor slots_;
  int64_t classes_ = 0;
  DeferredLabelCheck* previous_;
};
Tensor cross_entropy(const Tensor& logits, const Tensor& labels);
Tensor mse_loss(const Tensor& input, const Tensor& target);
Tensor l1_loss(const Tensor& input, const Tensor& target);

// x [N, C, H, W], weight [O, C, KH, KW], bias [O] or undefined.
// conv2d works through the batch a chunk of images at a time, so that its
// im2col buffer stays near this many bytes (default 32 MiB) instead of nine
// times the input. The chunks depend only on the shapes and this setting
// (per thread), never on the memory available, so results do not either.
void set_conv_workspace_bytes(int64_t bytes);
int64_t conv_workspace_bytes();
// `then_relu`: relu(conv2d(...)) — on CUDA's direct kernels in the same
// launches (the ReLU in the epilogue, its gradient folded into the backward
// kernels), elsewhere as the two operations.
Tensor conv2d(const Tensor& x, const Tensor& weight, const Tensor& bias, int64_t stride = 1,
              int64_t padding = 0, bool then_relu = false);
// Window `kernel`, stride `stride` (0: same as kernel), no padding.
Tensor max_pool2d(const Tensor& x, int64_t kernel, int64_t stride = 0);
// Zeroes elements with probability p and scales the rest by 1/(1-p) when
// `training`; identity otherwise. The mask comes from the engine generator,
// or inside a StepRandom from its seed and the step counter; backward
// draws it again from the same key rather than keeping it, so it must run
// before the counter moves (the optimizer's step, after backward, as in
// every training step).
Tensor dropout(const Tensor& x, double p, bool training);
// residual + dropout(x, p, training) in one pass over the three tensors (a
// transformer's residual connection): the same mask and the same bits as
// the two operations. residual and x of one shape, type and device; or,
// under bfloat16 autocast on CUDA, x bfloat16 (a product's output kept so)
// and residual float32: the sum is float32 (the bits of the two
// operations on x's values in float32) and x's gradient bfloat16.
Tensor add_dropout(const Tensor& residual, const Tensor& x, double p, bool training);

// Transformer layers (ops_transformer.cpp). float32 and float64; attention
// and layer norm's output also bfloat16 under autocast (autocast.h).
// Rows of `weight` [vocab, dim] at `index` (int64, any shape on weight's
// device): [index sizes..., dim]. Differentiable in `weight`; its gradient
// is a deterministic scatter-add (the same bits every run). An index out of
// [0, vocab) throws on the CPU; on CUDA (where checking would wait for the
// device) its row is zeros and nothing outside the table is read.
Tensor embedding(const Tensor& weight, const Tensor& index);
// (x - mean) / sqrt(var + eps) * weight + bias over the last dimension of
// x (biased variance, as PyTorch); weight and bias [C] (C = x's last size).
// Under bfloat16 autocast on CUDA, `out` may ask for a bfloat16 result for
// a norm whose output only feeds products (the statistics and every sum
// stay float32; its gradient then comes back in bfloat16, as autocast's
// cast before the product rounds it in PyTorch).
Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps = 1e-5,
                  ProductOut out = ProductOut::Float32);
// softmax(q kᵀ / sqrt(D)) v for q, k, v [B, H, T, D]; query i sees keys
// j <= i when `causal`. One fused kernel (the FlashAttention algorithm):
// nothing of size T × T is stored, forward or backward. CUDA takes head
// sizes up to 128.
Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    bool causal);
// Multi-head self-attention on a fused projection: qkv [batch, tokens,
// 3 × heads × head size] holds q, k and v (in that order, each [heads, head
// size] per token); the result is [batch, tokens, heads × head size], the
// heads merged. The same as splitting qkv into [batch, heads, tokens, head
// size] tensors, scaled_dot_product_attention, and merging the heads back,
// without the copies: the kernels read q, k and v in place and write the
// output, and backward the gradient of qkv, in these layouts.
Tensor self_attention(const Tensor& qkv, int64_t heads, bool causal);
// The same within a segment that runs again in backward (recompute.h),
// keeping the attention's output and its softmax statistics from the
// first run for the run again, which then skips the kernel: `kept` empty,
// the attention runs and, outside grad mode (the segment's first run),
// fills it; filled, the run again takes its output
// from it (the same bits: the qkv it is given is made again from the same
// input) and records backward as ever, and `kept` is empty again. A GPT
// block recomputed so keeps its attention's output (12 of the 216 MiB of
// activations its forward saves under autocast) for the attention
// kernel's forward, about two fifths of recomputing its attention half.
struct KeptAttention {
  SavedTensor o, lse;
  bool filled = false;
};
Tensor self_attention(const Tensor& qkv, int64_t heads, bool causal, KeptAttention& kept);

// Rows of `x` along dimension 0 at `index` (int64 [k] on x's device):
// shape [k, x.sizes()[1:]...]. Not differentiable (the data loader's
// batches); throws when x requires grad. Indices out of range throw on the
// CPU; on CUDA the caller guarantees them (they are not read back).
Tensor take_rows(const Tensor& x, const Tensor& index);
// The same into `out`, which must be contiguous, of x's dtype and device
// and of that shape: a CUDA graph's input gathered where the graph reads it.
void take_rows_into(const Tensor& out, const Tensor& x, const Tensor& index);

// Windows of a byte sequence held eight bytes to an int64 element
// (`bytes`, int64 [n] contiguous, `count` bytes in all: a text corpus, as
// data.h holds it, for want of a byte type), widened to int64: [k, width],
// row i the `width` bytes from index[i] × stride + offset (index int64 [k]
// on the same device). Not differentiable. Windows past the sequence's end
// throw on the CPU; on CUDA the caller guarantees them (as for take_rows).
Tensor take_byte_windows(const Tensor& bytes, int64_t count, const Tensor& index, int64_t width,
                         int64_t stride, int64_t offset);
// The same into `out` (contiguous int64 [k, width] on bytes' device).
void take_byte_windows_into(const Tensor& out, const Tensor& bytes, int64_t count,
                            const Tensor& index, int64_t stride, int64_t offset);

// Sums `g` down to `shape` (the reverse of broadcasting).
Tensor sum_to(const Tensor& g, const Shape& shape);
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);

}  // namespace leasehold::engine
