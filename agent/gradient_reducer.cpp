#include "agent/gradient_reducer.h"

#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/prefix_store.h>
#include <gloo/transport/tcp/device.h>
#include <spdlog/spdlog.h>

#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <thread>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "agent/gloo_ring.h"
#include "agent/job_runner.h"

#ifdef LEASEHOLD_HAVE_NCCL
#include <cuda_runtime.h>
#include <nccl.h>

#include "agent/engine/cuda_context.h"
#endif

namespace leasehold {
namespace {

namespace E = engine;

// The longest one collective may wait for the other replicas (a replica
// spilling to SSD mid-step is slow, not gone).
constexpr auto kCollectiveTimeout = std::chrono::minutes(5);

// ---- Host backend: Gloo over TCP, on a thread of its own ----

class GlooReducer final : public GradientReducer {
 public:
  GlooReducer(ReplicaStore& store, std::vector<E::Tensor> parameters,
              std::function<bool()> stopping)
      : GradientReducer(std::move(parameters), store.replica().world_size),
        stopping_(std::move(stopping)) {
    const Replica& r = store.replica();
    gloo::transport::tcp::attr attr(r.master_addr.c_str());
    try {
      auto device = gloo::transport::tcp::CreateDevice(attr);
      context_ = std::make_shared<gloo::rendezvous::Context>(r.rank, r.world_size);
      context_->setTimeout(kCollectiveTimeout);
      gloo::rendezvous::PrefixStore prefix("gloo", store);
      context_->connectFullMesh(prefix, device);
      ring_ = std::make_unique<GlooRing>(context_, kCollectiveTimeout);
    } catch (const JobCancelled&) {
      throw;
    } catch (const std::exception& e) {
      throw ReplicaLost("replica " + std::to_string(r.rank) +
                        " could not connect to the others (Gloo): " + e.what());
    }
    worker_ = std::thread([this] { work(); });
  }
  ~GlooReducer() override {
    {
      std::lock_guard lock(mu_);
      closing_ = true;
    }
    cv_.notify_all();
    // Ending while an all-reduce waits for the others (the job stops, a
    // replica is gone): the abort ends the wait now, not at its timeout.
    ring_->abort();
    worker_.join();
  }

 protected:
  void start(const std::vector<E::Tensor>& grads) override {
    {
      std::lock_guard lock(mu_);
      tasks_.push_back(grads);
    }
    cv_.notify_all();
  }
  void join() override {
    std::unique_lock lock(mu_);
    while (!tasks_.empty() || busy_) {
      if (!error_.empty()) break;
      if (stopping_ && stopping_()) throw JobCancelled();
      cv_.wait_for(lock, std::chrono::milliseconds(50));
    }
    if (!error_.empty()) throw ReplicaLost(error_);
  }

 private:
  void work() {
    std::unique_lock lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return closing_ || !tasks_.empty(); });
      if (closing_) return;
      std::vector<E::Tensor> grads = std::move(tasks_.front());
      tasks_.pop_front();
      busy_ = true;
      lock.unlock();
      std::string error;
      try {
        for (const E::Tensor& g : grads) {
          float* data = g.data<float>();
          const auto n = static_cast<size_t>(g.numel());
          if (!ring_->allreduce(data, n)) break;  // aborted: the reducer is closing
          const float scale = 1.0f / static_cast<float>(world_size_);
          for (size_t i = 0; i < n; ++i) data[i] *= scale;
        }
      } catch (const std::exception& e) {
        error = std::string("an all-reduce with the other replicas failed (Gloo): ") + e.what();
      }
      lock.lock();
      busy_ = false;
      if (!error.empty() && error_.empty()) error_ = error;
      cv_.notify_all();
    }
  }

  std::function<bool()> stopping_;
  std::shared_ptr<gloo::rendezvous::Context> context_;
  std::unique_ptr<GlooRing> ring_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::vector<E::Tensor>> tasks_;
  bool busy_ = false, closing_ = false;
  std::string error_;
  std::thread worker_;
};

#ifdef LEASEHOLD_HAVE_NCCL
// ---- CUDA backend: NCCL on a stream of its own ----

void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

class NcclReducer final : public GradientReducer {
 public:
  NcclReducer(ReplicaStore& store, int device, std::vector<E::Tensor> parameters,
              std::function<bool()> stopping)
      : GradientReducer(std::move(parameters), store.replica().world_size),
        device_(device),
        stopping_(std::move(stopping)) {
    const Replica& r = store.replica();
    check_cuda(cudaSetDevice(device_), "cudaSetDevice");
    ncclUniqueId id;
    if (r.rank == 0) {
      if (ncclResult_t e = ncclGetUniqueId(&id); e != ncclSuccess) {
        throw std::runtime_error(std::string("ncclGetUniqueId: ") + ncclGetErrorString(e));
      }
      store.set("nccl/id", std::vector<char>(id.internal, id.internal + sizeof id.internal));
    } else {
      std::vector<char> v = store.get("nccl/id");
      if (v.size() != sizeof id.internal) throw ReplicaLost("rank 0 sent a malformed NCCL id");
      std::memcpy(id.internal, v.data(), v.size());
    }
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    check_cuda(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming), "cudaEventCreate");
    check_cuda(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming), "cudaEventCreate");
    // A non-blocking communicator: its set-up, and any wait on another
    // replica, can be given up (the job stops, a replica never comes).
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclResult_t e = ncclCommInitRankConfig(&comm_, r.world_size, id, r.rank, &config);
    if (e != ncclSuccess && e != ncclInProgress) {
      throw ReplicaLost("replica " + std::to_string(r.rank) +
                        " could not join the others (NCCL): " + ncclGetErrorString(e));
    }
    settle("joining the other replicas");
    // NCCL connects the replicas' GPUs at the first collective (a few
    // hundred ms): done here, as part of connecting, not in the first step.
    E::Tensor warm = E::zeros({1}, {E::DType::Float32, E::Device::cuda(device_)});
    E::synchronize(device_);
    check(ncclAllReduce(warm.raw_data(), warm.raw_data(), 1, ncclFloat, ncclSum, comm_, stream_));
    settle("the first all-reduce");
    wait_stream("the first all-reduce", kCollectiveTimeout);
    // From here on a replica blocked in a collective whose peer is gone
    // would wait forever: once the job is being stopped, the watchdog
    // aborts the communicator, which ends its kernels.
    watchdog_ = std::thread([this] {
      std::unique_lock lock(mu_);
      while (!closing_) {
        cv_.wait_for(lock, std::chrono::milliseconds(100));
        if (!closing_ && !aborted_ && stopping_ && stopping_()) abort_locked("the job is stopping");
      }
    });
  }
  ~NcclReducer() override {
    {
      std::lock_guard lock(mu_);
      closing_ = true;
    }
    cv_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
    // Ending in an exception (a stop, a lost replica) or with work still
    // queued: the other replicas may never take part, so the communicator
    // is aborted, not waited for.
    bool clean = !aborted_ && comm_ && std::uncaught_exceptions() == 0 &&
                 !(stopping_ && stopping_());
    if (clean) {
      try {
        wait_stream("the last all-reduce", std::chrono::seconds(60));
      } catch (const std::exception& e) {
        spdlog::warn("data-parallel job: {}; aborting its NCCL communicator", e.what());
        clean = false;
      }
    }
    if (comm_) {
      if (clean) {
        ncclCommDestroy(comm_);
      } else if (!aborted_) {
        ncclCommAbort(comm_);
      }
    }
    if (ready_) cudaEventDestroy(ready_);
    if (done_) cudaEventDestroy(done_);
    if (stream_) cudaStreamDestroy(stream_);
  }

 protected:
  void start(const std::vector<E::Tensor>& grads) override {
    std::lock_guard lock(mu_);
    if (aborted_) throw JobCancelled();
    cudaStream_t compute = E::compute_stream(device_);
    // The gradients are written on the compute stream: the reduction
    // starts after them, on its own stream, while backward goes on.
    check_cuda(cudaEventRecord(ready_, compute), "cudaEventRecord");
    check_cuda(cudaStreamWaitEvent(stream_, ready_, 0), "cudaStreamWaitEvent");
    {
      Group group(*this);
      for (const E::Tensor& g : grads) {
        void* p = g.raw_data();
        check(ncclAllReduce(p, p, static_cast<size_t>(g.numel()), ncclFloat, ncclAvg, comm_,
                            stream_));
      }
    }
    settle_locked("an all-reduce");
  }
  void join() override {
    std::lock_guard lock(mu_);
    if (aborted_) throw JobCancelled();
    check_cuda(cudaEventRecord(done_, stream_), "cudaEventRecord");
    check_cuda(cudaStreamWaitEvent(E::compute_stream(device_), done_, 0), "cudaStreamWaitEvent");
    ncclResult_t async = ncclSuccess;
    ncclCommGetAsyncError(comm_, &async);
    if (async != ncclSuccess && async != ncclInProgress) {
      throw ReplicaLost(std::string("an all-reduce with the other replicas failed (NCCL): ") +
                        ncclGetErrorString(async));
    }
  }

 private:
  // ncclGroupStart/End, ended however the block is left (a group left open
  // would take in this thread's next NCCL calls).
  struct Group {
    explicit Group(NcclReducer& r) : r_(r) { r_.check(ncclGroupStart()); }
    ~Group() noexcept(false) {
      const ncclResult_t e = ncclGroupEnd();
      if (std::uncaught_exceptions() == 0) r_.check(e);
    }
    NcclReducer& r_;
  };

  void check(ncclResult_t e) {
    if (e != ncclSuccess && e != ncclInProgress) {
      throw ReplicaLost(std::string("an all-reduce with the other replicas failed (NCCL): ") +
                        ncclGetErrorString(e));
    }
  }
  // A non-blocking communicator's last call is done (for a collective:
  // queued on the stream), or fails; given up when the job stops or after
  // kCollectiveTimeout.
  void settle(const char* what) {
    std::lock_guard lock(mu_);
    settle_locked(what);
  }
  void settle_locked(const char* what) {
    const auto deadline = std::chrono::steady_clock::now() + kCollectiveTimeout;
    while (true) {
      ncclResult_t state = ncclInProgress;
      ncclCommGetAsyncError(comm_, &state);
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) {
        abort_locked("NCCL failed");
        throw ReplicaLost(std::string(what) + " with the other replicas failed (NCCL): " +
                          ncclGetErrorString(state));
      }
      if (stopping_ && stopping_()) {
        abort_locked("the job is stopping");
        throw JobCancelled();
      }
      if (std::chrono::steady_clock::now() >= deadline) {
        abort_locked("a replica did not come");
        throw ReplicaLost(std::string(what) + ": another replica did not take part within " +
                          std::to_string(kCollectiveTimeout.count() / 60) + " min");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  // Waits until the reduction stream is idle, the same way.
  void wait_stream(const char* what, std::chrono::milliseconds limit) {
    std::lock_guard lock(mu_);
    const auto deadline = std::chrono::steady_clock::now() + limit;
    while (true) {
      const cudaError_t q = cudaStreamQuery(stream_);
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) check_cuda(q, what);
      if (stopping_ && stopping_()) {
        abort_locked("the job is stopping");
        throw JobCancelled();
      }
      if (std::chrono::steady_clock::now() >= deadline) {
        abort_locked("a replica did not take part");
        throw ReplicaLost(std::string(what) + ": another replica did not take part within " +
                          std::to_string(limit.count() / 1000) + " s");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  void abort_locked(const char* why) {
    if (aborted_ || !comm_) return;
    spdlog::warn("data-parallel job: aborting its NCCL communicator ({})", why);
    ncclCommAbort(comm_);
    aborted_ = true;
  }

  const int device_;
  std::function<bool()> stopping_;
  ncclComm_t comm_ = nullptr;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ready_ = nullptr, done_ = nullptr;
  std::mutex mu_;
  std::condition_variable cv_;
  bool closing_ = false, aborted_ = false;
  std::thread watchdog_;
};
#endif

}  // namespace

std::unique_ptr<GradientReducer> GradientReducer::connect(ReplicaStore& store,
                                                          E::Device device,
                                                          std::vector<E::Tensor> parameters,
                                                          std::function<bool()> stopping) {
  for (const auto& p : parameters) {
    if (p.dtype() != E::DType::Float32 || !p.is_contiguous()) {
      throw std::invalid_argument("data-parallel jobs reduce float32 parameters only");
    }
  }
  if (device.is_cuda()) {
#ifdef LEASEHOLD_HAVE_NCCL
    return std::unique_ptr<GradientReducer>(
        new NcclReducer(store, device.index, std::move(parameters), std::move(stopping)));
#else
    throw std::runtime_error(
        "data-parallel jobs on GPUs need NCCL, and this agent was built without it");
#endif
  }
  return std::unique_ptr<GradientReducer>(
      new GlooReducer(store, std::move(parameters), std::move(stopping)));
}

GradientReducer::GradientReducer(std::vector<E::Tensor> parameters, int world_size)
    : world_size_(world_size), params_(std::move(parameters)) {
  // Buckets in reverse order: backward produces the last layers' gradients
  // first.
  bucket_of_.resize(params_.size());
  size_t bytes = 0;
  for (size_t i = params_.size(); i-- > 0;) {
    index_[params_[i].impl().get()] = i;
    const size_t size = static_cast<size_t>(params_[i].numel()) * sizeof(float);
    if (buckets_.empty() || bytes + size > kBucketBytes) {
      buckets_.emplace_back();
      bytes = 0;
    }
    buckets_.back().params.push_back(i);
    bucket_of_[i] = buckets_.size() - 1;
    bytes += size;
  }
  seen_.assign(params_.size(), false);
}

E::GradientReadyHook GradientReducer::hook() {
  return [this](const E::Tensor& leaf) { ready(leaf); };
}

void GradientReducer::ready(const E::Tensor& leaf) {
  auto it = index_.find(leaf.impl().get());
  if (it == index_.end()) return;  // not a parameter (an input that wanted gradients)
  const size_t i = it->second;
  if (seen_[i]) {
    throw std::logic_error(
        "a parameter received two gradients in one backward pass: data-parallel jobs need each "
        "parameter used once per step");
  }
  seen_[i] = true;
  Bucket& b = buckets_[bucket_of_[i]];
  if (++b.ready == b.params.size()) launch(bucket_of_[i]);
}

void GradientReducer::launch(size_t bucket) {
  Bucket& b = buckets_[bucket];
  std::vector<E::Tensor> grads;
  for (size_t i : b.params) {
    E::Tensor g = params_[i].grad();
    if (!g.defined()) {
      // Unused this step: its gradient is zero here, and maybe not on the
      // other replicas.
      g = E::zeros(params_[i].sizes(), params_[i].options());
      params_[i].set_grad(g);
    }
    if (!g.is_contiguous()) {
      g = g.contiguous();
      params_[i].set_grad(g);
    }
    grads.push_back(g);
  }
  b.launched = true;
  start(grads);
}

void GradientReducer::end_step() {
  for (size_t k = 0; k < buckets_.size(); ++k) {
    if (!buckets_[k].launched) launch(k);
  }
  join();
  std::fill(seen_.begin(), seen_.end(), false);
  for (auto& b : buckets_) {
    b.ready = 0;
    b.launched = false;
  }
}

std::string GradientReducer::digest(const std::vector<E::Tensor>& parameters) {
  XXH3_state_t* state = XXH3_createState();
  XXH3_64bits_reset(state);
  for (const auto& p : parameters) {
    E::Tensor host = p.detach().to(E::Device::cpu()).contiguous();
    XXH3_64bits_update(state, host.raw_data(),
                       static_cast<size_t>(host.numel()) * E::dtype_size(host.dtype()));
  }
  const XXH64_hash_t h = XXH3_64bits_digest(state);
  XXH3_freeState(state);
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(h));
  return text;
}

}  // namespace leasehold
