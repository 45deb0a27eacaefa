#include "tests/engine/recompute_check.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "agent/engine/allocator.h"
#include "agent/engine/autocast.h"
#include "agent/engine/autograd.h"
#include "agent/engine/host_offload.h"
#include "agent/engine/nn.h"
#include "agent/engine/ops.h"
#include "tests/engine/counting_allocator.h"

namespace leasehold::engine {
namespace {

using Recompute = nn::TransformerBlock::Recompute;

struct Step {
  std::vector<float> loss;
  std::vector<std::vector<float>> grads;  // every parameter's, in order
  uint64_t kept_bytes = 0;  // allocator bytes alive between forward and backward, over the start
  uint64_t backward_bytes = 0;  // the most bytes backward added to those at once
  uint64_t backward_allocated = 0;  // every byte backward allocated, summed
  int most_ready_calls = 0;  // the most gradient-ready calls for one parameter
  int sums_made = 0;  // allocations by the leaves' accumulators: gradients summed anew
};

// `dim` wide, on `batch` sequences of 40 tokens (vocabulary 64).
Step gpt_step(Device device, Recompute recompute, bool autocast, bool offload = false,
              int64_t mlp_parts = 1, int64_t dim = 64, int64_t batch = 4) {
  manual_seed(52);
  auto emb = std::make_shared<nn::Embedding>(64, dim, 48);
  nn::Sequential model;
  model.push_back(emb);
  // (One block more than forward goes past before a stashed input leaves
  // the device, host_offload.h: the first blocks' inputs leave in forward.)
  for (uint64_t i = 0; i <= kOffloadReleaseAfterBlocks; ++i) {
    auto block = std::make_shared<nn::TransformerBlock>(dim, 4, 0.2, 2);
    block->set_recompute(recompute);
    block->set_mlp_parts(mlp_parts);
    block->set_offload(offload ? nn::TransformerBlock::Offload::Inputs
                               : nn::TransformerBlock::Offload::None);
    model.push_back(block);
  }
  model.push_back(std::make_shared<nn::LayerNorm>(dim));
  model.push_back(std::make_shared<nn::TiedOutput>(emb));
  model.to(device);
  std::vector<int64_t> tokens, targets;
  for (int64_t i = 0; i < batch * 40; ++i) {
    tokens.push_back((i * 37 + 11) % 64);
    targets.push_back((i * 53 + 5) % 64);
  }
  Tensor x = from_vector(tokens, {batch, 40}).to(device);
  Tensor y = from_vector(targets, {batch * 40}).to(device);
  Tensor step = zeros({}, {DType::Int64, device});

  Step r;
  auto allocator = std::make_shared<CountingAllocator>(current_allocator(device));
  AllocatorGuard counted(allocator);
  // (Counted where memory is handed out and returned, on the host.)
  const uint64_t start = allocator->stats().in_use_bytes;
  Tensor loss;
  {
    StepRandom random(9, step);
    std::optional<AutocastGuard> ac;
    if (autocast) ac.emplace(DType::BFloat16);
    loss = cross_entropy(model(x).reshape({batch * 40, 64}), y);
  }
  r.kept_bytes = allocator->stats().in_use_bytes - start;
  allocator->restart_peak();
  const uint64_t allocated_before = allocator->allocated();
  allocator->on_allocate = [&](size_t) {
    r.sums_made += std::string_view(backward_node_running()) == "AccumulateGrad";
  };
  std::map<const TensorImpl*, int> ready_calls;
  {
    GradientReadyGuard ready([&](const Tensor& leaf) { ++ready_calls[leaf.impl().get()]; });
    loss.backward();
  }
  for (const Tensor& p : model.parameters()) {
    r.most_ready_calls = std::max(r.most_ready_calls, ready_calls[p.impl().get()]);
  }
  allocator->on_allocate = nullptr;
  r.backward_bytes = allocator->stats().peak_in_use_bytes - start - r.kept_bytes;
  r.backward_allocated = allocator->allocated() - allocated_before;
  r.loss = loss.detach().to(Device::cpu()).to_vector<float>();
  for (const Tensor& p : model.parameters()) {
    r.grads.push_back(p.grad().to(DType::Float32).to(Device::cpu()).to_vector<float>());
  }
  return r;
}

std::string mode_name(Recompute r) {
  return r == Recompute::Mlp                 ? "MLPs recomputed"
         : r == Recompute::BlockButAttention ? "blocks but their attention recomputed"
         : r == Recompute::Halves            ? "halves recomputed"
         : r == Recompute::Block             ? "whole blocks recomputed"
                                             : "whole blocks recomputed in halves";
}

}  // namespace

std::string recompute_mismatch(Device device, bool autocast) {
  const Step kept = gpt_step(device, Recompute::None, autocast);
  // Each mode keeps less than the one before it, but halves only less
  // than the MLPs (not than blocks but their attention: without autocast
  // the attention's output is as large as the second input halves keep).
  uint64_t less_than = kept.kept_bytes, mlp_kept = 0, but_attention_kept = 0;
  uint64_t halves_backward = 0, but_attention_allocated = 0;
  uint64_t block_kept = 0, block_backward = 0;
  for (Recompute r : {Recompute::Mlp, Recompute::BlockButAttention, Recompute::Halves,
                      Recompute::Block, Recompute::BlockInHalves}) {
    const std::string mode = mode_name(r);
    const Step again = gpt_step(device, r, autocast);
    // The whole block in halves keeps what the whole block keeps, and its
    // backward needs what the halves' does, not what the whole block's.
    if (r == Recompute::BlockInHalves) {
      if (again.kept_bytes != block_kept) {
        return mode + ": " + std::to_string(again.kept_bytes) +
               " bytes kept, not the whole blocks' " + std::to_string(block_kept);
      }
      if (again.backward_bytes >= block_backward) {
        return mode + ": backward needed " + std::to_string(again.backward_bytes) +
               " bytes more at once, not under the whole blocks' " +
               std::to_string(block_backward);
      }
      less_than = block_kept + 1;
    }
    if (r == Recompute::Block) {
      block_kept = again.kept_bytes;
      block_backward = again.backward_bytes;
    }
    if (r == Recompute::Halves) {
      halves_backward = again.backward_bytes;
      less_than = mlp_kept;
    }
    if (r == Recompute::BlockButAttention) {
      but_attention_allocated = again.backward_allocated;
      but_attention_kept = again.kept_bytes;
    }
    if (r == Recompute::Block && again.kept_bytes >= but_attention_kept) {
      return mode + ": " + std::to_string(again.kept_bytes) +
             " bytes kept, not under the blocks but their attention's " +
             std::to_string(but_attention_kept);
    }
    // The halves' backward holds one half's activations at a time, the
    // whole block's both.
    if (r == Recompute::Block && again.backward_bytes <= halves_backward) {
      return mode + ": backward needed " + std::to_string(again.backward_bytes) +
             " bytes more at once, not over the halves' " + std::to_string(halves_backward);
    }
    // A block but its attention does not make the attention's output again.
    if (r == Recompute::Block && again.backward_allocated <= but_attention_allocated) {
      return "blocks but their attention recomputed: backward allocated " +
             std::to_string(but_attention_allocated) + " bytes, not under the whole blocks' " +
             std::to_string(again.backward_allocated);
    }
    if (again.loss != kept.loss) return mode + ": the loss differs";
    if (again.grads.size() != kept.grads.size()) return mode + ": another number of gradients";
    for (size_t i = 0; i < kept.grads.size(); ++i) {
      if (again.grads[i] != kept.grads[i]) {
        return mode + ": parameter " + std::to_string(i) + "'s gradient differs";
      }
    }
    if (again.kept_bytes >= less_than) {
      return mode + ": " + std::to_string(again.kept_bytes) + " bytes kept, not under " +
             std::to_string(less_than);
    }
    // The same with the segments' inputs in host memory (host_offload.h):
    // the same bits, and less kept on the device (the first block's
    // inputs leave once forward is past kOffloadReleaseAfterBlocks blocks;
    // the later ones stay until backward reads them there).
    const Step offloaded = gpt_step(device, r, autocast, /*offload=*/true);
    if (offloaded.loss != kept.loss) return mode + " with inputs offloaded: the loss differs";
    for (size_t i = 0; i < kept.grads.size(); ++i) {
      if (offloaded.grads[i] != kept.grads[i]) {
        return mode + " with inputs offloaded: parameter " + std::to_string(i) +
               "'s gradient differs";
      }
    }
    if (offloaded.kept_bytes >= again.kept_bytes) {
      return mode + " with inputs offloaded: " + std::to_string(offloaded.kept_bytes) +
             " bytes kept, not under " + std::to_string(again.kept_bytes) + " without";
    }
    less_than = again.kept_bytes;
    if (r == Recompute::Mlp) mlp_kept = again.kept_bytes;
  }
  if (less_than * 2 >= kept.kept_bytes) {
    return "whole blocks recomputed keep " + std::to_string(less_than) +
           " bytes, not under half of " +
           std::to_string(kept.kept_bytes);
  }
  return "";
}

std::string sliced_mlp_mismatch(Device device, bool autocast) {
  // (Wider, on more sequences: the MLPs' activations, not what else
  // backward allocates, decide its peak; on a GPU, where they are
  // bfloat16 and products take workspaces, more again.)
  const int64_t kDim = device.is_cuda() ? 256 : 128, kBatch = device.is_cuda() ? 32 : 8;
  const Step kept = gpt_step(device, Recompute::None, autocast, false, 1, kDim, kBatch);
  // (Float32 sums in another order; under autocast, products of other
  // shapes rounded to bfloat16 where the whole batch's were.)
  const double tolerance = autocast ? 2e-2 : 1e-5;
  for (Recompute r : {Recompute::Mlp, Recompute::BlockButAttention, Recompute::Halves,
                      Recompute::Block, Recompute::BlockInHalves}) {
    const std::string mode = mode_name(r) + ", MLPs in slices";
    const Step whole = gpt_step(device, r, autocast, false, 1, kDim, kBatch);
    const Step sliced = gpt_step(device, r, autocast, /*offload=*/false, /*mlp_parts=*/4, kDim,
                                 kBatch);
    if (sliced.loss != kept.loss) return mode + ": the loss differs";
    if (sliced.grads.size() != kept.grads.size()) return mode + ": another number of gradients";
    for (size_t i = 0; i < kept.grads.size(); ++i) {
      double scale = 0, off = 0;
      for (size_t k = 0; k < kept.grads[i].size(); ++k) {
        scale = std::max(scale, std::fabs(static_cast<double>(kept.grads[i][k])));
        off = std::max(off, std::fabs(static_cast<double>(sliced.grads[i][k]) - kept.grads[i][k]));
      }
      if (!(off <= tolerance * std::max(scale, 1e-6))) {
        return mode + ": parameter " + std::to_string(i) + "'s gradient is " +
               std::to_string(off) + " off, over " + std::to_string(tolerance) + " of " +
               std::to_string(scale);
      }
    }
    if (sliced.most_ready_calls != 1) {
      return mode + ": a parameter's gradient was ready " +
             std::to_string(sliced.most_ready_calls) + " times, not once";
    }
    // (Under autocast on a GPU, each slice after the first adds its part
    // of every parameter's gradient to the sum so far as it makes it:
    // autograd.h, gradient_to_add_into. Elsewhere the weights' products
    // do, and the other sums are made anew.)
    if (device.is_cuda() && autocast && sliced.sums_made != whole.sums_made) {
      return mode + ": " + std::to_string(sliced.sums_made) +
             " gradients summed anew in slices, not the " + std::to_string(whole.sums_made) +
             " of the MLPs run again whole";
    }
    if (sliced.kept_bytes != whole.kept_bytes) {
      return mode + ": " + std::to_string(sliced.kept_bytes) + " bytes kept, not the " +
             std::to_string(whole.kept_bytes) + " of the MLPs run again whole";
    }
    // (Where the block runs again whole, its MLP's backward holds the
    // step's backward peak; an MLP run again alone may not, and then the
    // slices' gradient buffers are all it adds.)
    const bool whole_block = r == Recompute::Block || r == Recompute::BlockButAttention ||
                             r == Recompute::BlockInHalves;
    if (whole_block && sliced.backward_bytes >= whole.backward_bytes) {
      return mode + ": backward needed " + std::to_string(sliced.backward_bytes) +
             " bytes more at once, not under the " + std::to_string(whole.backward_bytes) +
             " of the MLPs run again whole";
    }
  }
  return "";
}

std::string outputs_unread_mismatch(Device device) {
  auto run = [device](bool unread, bool relu, double p) {
    manual_seed(4);
    auto leaf = [device](const Shape& shape) {
      return randn(shape).to(device).set_requires_grad(true);
    };
    Tensor w = leaf({3, 4}), b = leaf({3}), x = leaf({5, 4}), r = leaf({5, 3});
    Tensor step = zeros({}, {DType::Int64, device});
    StepRandom random(7, step);
    Tensor out;
    {
      OutputsUnreadGuard guard(unread);
      out = add_dropout(r, linear(x, w, b, relu), p, true);
    }
    Tensor g =
        from_vector<float>({1, -2, 3, 0.5f, 2, -1, 1, 1, -3, 2, 0.25f, 4, -1, 2, 1}, {5, 3})
            .to(device);
    out.backward(g);
    std::vector<std::vector<float>> grads;
    for (const Tensor& t : {w, b, x, r}) {
      grads.push_back(t.grad().to(Device::cpu()).to_vector<float>());
    }
    return grads;
  };
  for (double p : {0.5, 0.0}) {
    for (bool relu : {false, true}) {
      if (run(true, relu, p) != run(false, relu, p)) {
        return std::string("unread outputs changed the gradients (") +
               (relu ? "fused ReLU" : "no ReLU") + ", p " + std::to_string(p) + ")";
      }
    }
  }
  if (outputs_unread()) return "the guard outlived its scope";
  return "";
}

}  // namespace leasehold::engine
