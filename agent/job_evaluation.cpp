#include "agent/job_evaluation.h"

#include "agent/engine/autocast.h"
#include "agent/engine/autograd.h"
#include "agent/engine/ops.h"

namespace leasehold {

namespace E = engine;

E::Tensor batch_loss(const E::Tensor& logits, const E::Tensor& targets) {
  if (logits.dim() == 3) {
    return E::cross_entropy(logits.reshape({-1, logits.size(2)}), targets.reshape({-1}));
  }
  return E::cross_entropy(logits, targets);
}

Evaluation evaluate(E::nn::Module& model, const E::data::Dataset& test, E::Device device,
                    bool text) {
  E::NoGradGuard no_grad;
  model.eval();
  // (Under autocast, the weights' bfloat16 copies once for every batch.)
  E::AutocastWeights weight_copies(model.product_parameters());
  // Text samples are whole sequences: fewer at a time.
  E::data::BatchIterator it(test, text ? 16 : 1000, false, 0);
  E::Tensor x, y;
  // (float64 sums: exact counts and no drift over many tokens)
  E::Tensor correct = E::zeros({}, {E::DType::Float64, device});
  E::Tensor loss_sum = E::zeros({}, {E::DType::Float64, device});
  double predictions = 0;
  while (it.next(x, y, device)) {
    E::Tensor out = model(x);
    const int64_t classes = out.size(-1);
    E::Tensor flat = out.reshape({-1, classes}), labels = y.reshape({-1});
    const auto n = static_cast<double>(labels.numel());
    correct = E::add(correct, E::sum(E::eq(E::argmax(flat, 1), labels)).to(E::DType::Float64));
    if (text) {
      loss_sum = E::add(loss_sum, E::mul(E::cross_entropy(flat, labels).to(E::DType::Float64), n));
    }
    predictions += n;
  }
  model.train();
  if (predictions == 0) return {};
  return {correct.item() / predictions, text ? loss_sum.item() / predictions : 0.0};
}

}  // namespace leasehold
