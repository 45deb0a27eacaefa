// A data-parallel engine job's gradients, averaged over its replicas while
// backward runs. The parameters are grouped in buckets of about
// kBucketBytes, in reverse order (the order backward finishes them); as
// soon as every gradient of a bucket has been accumulated (the engine's
// GradientReadyHook), the bucket's all-reduce starts: on a CUDA stream of
// its own with NCCL on the cuda backend, on a thread of its own with Gloo
// on the host backend. end_step() then makes the optimiser wait for the
// last bucket (the compute stream waits on an event; no host sync).
//
// All replicas hold bit-identical parameters after each step (the
// all-reduce hands every replica the same sums); digest() lets the job
// check so at each epoch's end.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "agent/engine/autograd.h"
#include "agent/engine/tensor.h"
#include "agent/replica_store.h"

namespace leasehold {

class GradientReducer {
 public:
  static constexpr size_t kBucketBytes = 4u << 20;

  // Connects to the other replicas through `store` (NCCL on a CUDA
  // device, Gloo on the CPU). `parameters`: the model's, in the order
  // forward uses them. `stopping` (thread-safe) aborts a wait for another
  // replica. Throws ReplicaLost when the replicas cannot connect.
  static std::unique_ptr<GradientReducer> connect(ReplicaStore& store, engine::Device device,
                                                  std::vector<engine::Tensor> parameters,
                                                  std::function<bool()> stopping);
  virtual ~GradientReducer() = default;

  // The hook for the backward pass of one step (install it with a
  // GradientReadyGuard around loss.backward()).
  engine::GradientReadyHook hook();
  // After backward: reduces what backward did not reach (a parameter
  // without a gradient gets zeros) and makes the optimiser's step wait for
  // every bucket. Throws ReplicaLost when another replica is gone, and
  // JobCancelled when `stopping` ended a wait.
  void end_step();
  // A digest of the parameters' bytes (they are read from the device).
  static std::string digest(const std::vector<engine::Tensor>& parameters);

 protected:
  GradientReducer(std::vector<engine::Tensor> parameters, int world_size);
  // Starts averaging `grads` (float32, contiguous) over the replicas.
  virtual void start(const std::vector<engine::Tensor>& grads) = 0;
  // The optimiser's next work waits until everything started is done.
  virtual void join() = 0;

  const int world_size_;

 private:
  void ready(const engine::Tensor& leaf);
  void launch(size_t bucket);

  struct Bucket {
    std::vector<size_t> params;
    size_t ready = 0;
    bool launched = false;
  };
  std::vector<engine::Tensor> params_;
  std::unordered_map<const void*, size_t> index_;  // a leaf's TensorImpl -> its parameter
  std::vector<size_t> bucket_of_;
  std::vector<bool> seen_;
  std::vector<Bucket> buckets_;
};

}  // namespace leasehold
