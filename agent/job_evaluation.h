// What an engine job computes of a batch and of its test set: the loss a
// step minimizes, and the evaluation after each epoch (accuracy, and for a
// text model the validation loss). The job runner's step and its reports
// read these; the step's bits do not depend on which one asks.
#pragma once

#include "agent/engine/data.h"
#include "agent/engine/nn.h"
#include "agent/engine/tensor.h"

namespace leasehold {

// The loss of a batch: cross-entropy over classes, or over every position's
// next token for a text model (logits [B, T, V], targets [B, T]).
engine::Tensor batch_loss(const engine::Tensor& logits, const engine::Tensor& targets);

struct Evaluation {
  double accuracy = 0;  // of the class (or next token) predicted
  double loss = 0;      // mean cross-entropy; text jobs only
};

// `model` over `test` in eval mode without gradients (under autocast, the
// weights' bfloat16 copies made once for every batch), batches of 1,000
// samples or 16 text sequences; back in training mode after. Waits for the
// device.
Evaluation evaluate(engine::nn::Module& model, const engine::data::Dataset& test,
                    engine::Device device, bool text);

}  // namespace leasehold
