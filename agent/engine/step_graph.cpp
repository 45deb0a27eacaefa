#include "agent/engine/step_graph.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "agent/engine/autograd.h"
#include "agent/engine/cuda_context.h"
#include "agent/engine/memory_plan.h"
#include "shared/units.h"

#ifdef LEASEHOLD_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "shared/cuda_check.h"
#endif

namespace leasehold::engine {

namespace {

// Places in the arena: aligned as the trace's addresses were (allocator.h).
constexpr uint64_t kArenaAlignment = TraceAddresses::kAlignment;

// What is live where a traced step holds the most, for the debug log: the
// event of the peak among `events` and the live blocks' sizes, largest
// first, each with its count ("the peak, 639.35 MiB, at event 248 of 916,
// made in LinearBackward's backward: 2 x 48.00 MiB (1 made in ...; 1
// made outside backward ...), ..."; sizes as asked, before the arena's
// alignment), which says which tensors a memory budget should go after.
// `made_in[i]`: where blocks[i] was made.
std::string describe_peak(const std::vector<PlannedBlock>& blocks,
                          const std::vector<std::string>& made_in, uint64_t events) {
  std::vector<std::pair<uint64_t, int64_t>> changes;  // (event, bytes made or freed)
  changes.reserve(2 * blocks.size());
  for (const PlannedBlock& b : blocks) {
    changes.emplace_back(b.first, static_cast<int64_t>(b.bytes));
    changes.emplace_back(b.last, -static_cast<int64_t>(b.bytes));
  }
  std::sort(changes.begin(), changes.end());
  int64_t live = 0, most = 0;
  uint64_t at = 0;
  for (const auto& [event, bytes] : changes) {
    live += bytes;
    if (live > most) most = live, at = event;
  }
  // (Per size, how many; for sizes of a mebibyte or more, also where they
  // were made, which names the tensors.)
  std::map<uint64_t, std::map<std::string, int>, std::greater<>> sizes;
  std::string where;
  for (size_t i = 0; i < blocks.size(); ++i) {
    const PlannedBlock& b = blocks[i];
    if (b.first <= at && at < b.last) ++sizes[b.bytes][made_in[i]];
    if (b.first == at) where = made_in[i];
  }
  std::string out = fmt::format("the peak, {}, at event {} of {}, made {}:",
                                format_bytes(static_cast<uint64_t>(most)), at, events, where);
  const char* sep = " ";
  for (const auto& [bytes, made] : sizes) {
    int count = 0;
    for (const auto& [place, n] : made) count += n;
    out += fmt::format("{}{} x {}", sep, count, format_bytes(bytes));
    if (bytes >= (uint64_t{1} << 20)) {
      const char* inner = " (";
      for (const auto& [place, n] : made) {
        out += fmt::format("{}{} made {}", inner, n, place);
        inner = "; ";
      }
      out += ")";
    }
    sep = ", ";
  }
  return out;
}

}  // namespace

GraphPool::GraphPool(std::shared_ptr<Allocator> upstream, uint64_t trace_bytes)
    : upstream_(std::move(upstream)), trace_bytes_(trace_bytes) {}

GraphPool::~GraphPool() {
  // (Work queued on the stream that still uses the memory runs before any
  // later work in it: it goes back as any tensor's memory does.)
  if (arena_) upstream_->deallocate(arena_, arena_bytes_);
}

void* GraphPool::allocate(size_t bytes) {
  std::lock_guard lock(mu_);
  ++stats_.allocations;
  if (phase_ == Phase::Capturing) return place_captured(bytes);
  if (phase_ != Phase::Tracing) {
    throw std::logic_error("graph pool: allocations are made while tracing or capturing");
  }
  if (!addresses_) addresses_ = std::make_unique<TraceAddresses>(device(), trace_bytes_);
  // (Room first: nothing below may fail once the address is taken.)
  if (trace_.size() == trace_.capacity()) trace_.reserve(std::max<size_t>(256, 2 * trace_.size()));
  void* p = addresses_->take(bytes);
  try {
    traced_live_.emplace(p, trace_.size());
  } catch (...) {
    addresses_->give_back(p);
    throw;
  }
  trace_.push_back({bytes, events_++, UINT64_MAX, backward_node_running(), in_backward()});
  stats_.in_use_bytes += bytes;
  stats_.peak_in_use_bytes = std::max(stats_.peak_in_use_bytes, stats_.in_use_bytes);
  return p;
}

void* GraphPool::place_captured(size_t bytes) {
  const size_t i = next_;
  if (i >= trace_.size() || trace_[i].bytes != bytes) {
    throw std::runtime_error(
        "the captured step's allocation " + std::to_string(i + 1) + " is of " +
        format_bytes(bytes) + ", " +
        (i < trace_.size() ? "its trace's of " + format_bytes(trace_[i].bytes)
                           : "its trace made only " + std::to_string(trace_.size())));
  }
  // The plan lets this one share bytes with any block the trace had
  // freed by now: none of those may still be alive here.
  for (const auto& [ptr, j] : arena_live_) {
    if (trace_[j].last <= trace_[i].first) {
      throw std::runtime_error("the captured step keeps its allocation " + std::to_string(j + 1) +
                               " (" + format_bytes(trace_[j].bytes) +
                               ") alive longer than its trace did");
    }
  }
  void* p = static_cast<char*>(arena_) + offsets_[i];
  if (!arena_live_.emplace(p, i).second) {
    throw std::logic_error("graph pool: two live allocations planned at one place");
  }
  ++next_;
  arena_in_use_ += bytes;
  stats_.in_use_bytes += bytes;
  stats_.peak_in_use_bytes = std::max(stats_.peak_in_use_bytes, stats_.in_use_bytes);
  return p;
}

void GraphPool::deallocate(void* ptr, size_t bytes) noexcept {
  std::lock_guard lock(mu_);
  if (auto it = arena_live_.find(ptr); it != arena_live_.end()) {
    arena_live_.erase(it);  // (its place is the plan's to reuse)
    arena_in_use_ -= bytes;
    stats_.in_use_bytes -= bytes;
    return;
  }
  auto it = traced_live_.find(ptr);
  if (it == traced_live_.end() || phase_ != Phase::Tracing) {
    spdlog::error("graph pool: a free of memory it did not hand out ({} at {})",
                  format_bytes(bytes), ptr);
    return;
  }
  trace_[it->second].last = events_++;
  traced_live_.erase(it);
  stats_.in_use_bytes -= bytes;
  try {
    addresses_->give_back(ptr);
  } catch (const std::bad_alloc&) {
    // (The address is not reused: the trace may run out of them sooner.)
  }
}

void GraphPool::plan() {
  std::vector<PlannedBlock> blocks;
  {
    std::lock_guard lock(mu_);
    if (phase_ != Phase::Tracing) throw std::logic_error("graph pool: planned twice");
    if (!traced_live_.empty()) {
      throw std::logic_error("graph pool: " + std::to_string(traced_live_.size()) +
                             " tensors of the traced step are still alive (they have no "
                             "memory behind them)");
    }
    addresses_.reset();
    blocks.reserve(trace_.size());
    for (const Traced& t : trace_) blocks.push_back({t.bytes, t.first, t.last});
    arena_live_.reserve(trace_.size());
    if (spdlog::should_log(spdlog::level::debug) && !blocks.empty()) {
      std::vector<std::string> made_in;
      made_in.reserve(trace_.size());
      for (const Traced& t : trace_) made_in.push_back(where_made(t));
      spdlog::debug("graph pool: in the traced step, {}",
                    describe_peak(blocks, made_in, events_));
    }
  }
  MemoryPlan plan = plan_memory(blocks, kArenaAlignment);
  void* arena = nullptr;
  if (plan.arena_bytes > 0) {
    // (Memory idle in the upstream, of the steps run op by op, is where
    // the arena should go. Without the lock: upstream may reclaim memory.)
    upstream_->reuse_idle(plan.arena_bytes);
    arena = upstream_->allocate(plan.arena_bytes);
  }
  std::lock_guard lock(mu_);
  arena_ = arena;
  arena_bytes_ = plan.arena_bytes;
  peak_live_ = plan.peak_live_bytes;
  offsets_ = std::move(plan.offsets);
  phase_ = Phase::Planned;
}

void GraphPool::set_capturing(bool capturing) {
  std::lock_guard lock(mu_);
  if (capturing) {
    if (phase_ != Phase::Planned) throw std::logic_error("graph pool: captured before planned");
    phase_ = Phase::Capturing;
  } else if (phase_ == Phase::Capturing) {
    phase_ = Phase::Captured;
  }
}

std::string GraphPool::capture_mismatch() const {
  std::lock_guard lock(mu_);
  if (next_ == trace_.size()) return "";
  return "the captured step made " + std::to_string(next_) + " allocations, its trace " +
         std::to_string(trace_.size());
}

AllocatorStats GraphPool::stats() const {
  std::lock_guard lock(mu_);
  AllocatorStats s = stats_;
  s.cached_bytes = arena_bytes_ - arena_in_use_;
  return s;
}

uint64_t GraphPool::held_bytes() const {
  std::lock_guard lock(mu_);
  return arena_bytes_;
}

uint64_t GraphPool::peak_live_bytes() const {
  std::lock_guard lock(mu_);
  return peak_live_;
}

size_t GraphPool::live_allocations() const {
  std::lock_guard lock(mu_);
  return traced_live_.size() + arena_live_.size();
}

std::string GraphPool::where_made(const Traced& t) {
  if (*t.node != '\0') return fmt::format("in {}'s backward", t.node);
  return t.in_backward ? "in backward, by its engine (a sum)"
                       : "outside backward (forward or the update)";
}

std::string GraphPool::describe_live() const {
  std::lock_guard lock(mu_);
  // (size, where made) -> the trace's events that made them
  std::map<std::pair<uint64_t, std::string>, std::vector<uint64_t>, std::greater<>> live;
  for (const auto* places : {&traced_live_, &arena_live_}) {
    for (const auto& [place, i] : *places) {
      live[{trace_[i].bytes, where_made(trace_[i])}].push_back(trace_[i].first);
    }
  }
  std::string out;
  for (auto& [key, events] : live) {
    std::sort(events.begin(), events.end());
    std::string at;
    for (uint64_t e : events) at += (at.empty() ? "" : ", ") + std::to_string(e);
    out += fmt::format("{}{} x {} (made {}, events {} of {})", out.empty() ? "" : ", ",
                       events.size(), format_bytes(key.first), key.second, at, events_);
  }
  return out;
}

StepGraph::StepGraph(Device device, std::function<void()> step,
                     std::function<void()> after_trace)
    : device_(device), step_(std::move(step)), after_trace_(std::move(after_trace)) {
  if (!device_.is_cuda()) why_not_ = "CUDA graphs are for CUDA devices; this step runs on the CPU";
}

StepGraph::~StepGraph() {
#ifdef LEASEHOLD_HAVE_CUDA
  if (!exec_) return;
  // The last launch finishes before its graph goes (a job stopped between
  // steps has not waited for it); a fault there is the next call's to report.
  if (cudaStream_t stream = existing_compute_stream(device_.index)) {
    note_host_wait();
    (void)cudaStreamSynchronize(stream);
  }
  cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
#endif
}

bool StepGraph::run() {
  if (exec_) {
    launch();
    return true;
  }
  if (!why_not_.empty()) return false;
  if (trace() && capture()) {
    launch();
    return true;
  }
  pool_.reset();  // (its memory goes when the step's tensors in it do)
  return false;
}

#ifdef LEASEHOLD_HAVE_CUDA
namespace {

// Addresses for a step's trace: twice the device's memory. Freed ones are
// reused for the same size only, so a trace may use more than the step's
// peak; one that needs more than this is taken not to fit.
uint64_t trace_address_bytes(int device) {
  size_t free_bytes = 0, total_bytes = 0;
  LEASEHOLD_CUDA_CHECK(cudaSetDevice(device));
  LEASEHOLD_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  return 2 * static_cast<uint64_t>(total_bytes);
}

}  // namespace

std::string StepGraph::captured(void** graph) {
  cudaStream_t stream = compute_stream(device_.index);
  std::string failure;
  // Frees of memory outside the pool wait for the capture's end; the
  // pool's own places are reused within it as planned (allocator.h).
  DeferFreesGuard defer(pool_.get());
  AllocatorGuard use_pool(pool_);
  // Relaxed: another thread's allocator may map pages meanwhile (not a
  // stream operation, and safe to capture around).
  cudaError_t err = cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return std::string("cannot capture the compute stream: ") + cudaGetErrorString(err);
  }
  try {
    step_();
  } catch (const OutOfMemoryError& e) {
    failure = e.what();
    out_of_memory_ = true;
  } catch (const std::exception& e) {
    failure = e.what();
  }
  cudaGraph_t g = nullptr;
  err = cudaStreamEndCapture(stream, &g);
  *graph = g;
  if (failure.empty() && err != cudaSuccess) {
    failure = std::string("the capture was invalidated: ") + cudaGetErrorString(err);
  }
  if (failure.empty() && !defer.all_deferred()) failure = "a free during the capture was not deferred";
  (void)cudaGetLastError();
  return failure;
}

bool StepGraph::trace() {
  const auto t_start = std::chrono::steady_clock::now();
  pool_ = std::make_shared<GraphPool>(current_allocator(device_),
                                      trace_address_bytes(device_.index));
  void* graph = nullptr;
  std::string failure;
  {
    TracingStepGuard tracing;
    failure = captured(&graph);
  }
  if (graph) cudaGraphDestroy(static_cast<cudaGraph_t>(graph));  // (never run)
  // What the step left (its gradients, its loss) has no memory behind it.
  if (after_trace_) after_trace_();
  if (const size_t alive = pool_->live_allocations()) {
    why_not_ = "its trace left tensors alive";
    throw std::logic_error("a CUDA graph's traced step left " + std::to_string(alive) +
                           " tensors alive past its trace, which have no memory behind them");
  }
  if (!failure.empty()) {
    why_not_ = "tracing it for a CUDA graph failed: " + failure;
    return false;
  }
  trace_ms_ = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t_start)
                  .count();
  return true;
}

bool StepGraph::capture() {
  const auto t_start = std::chrono::steady_clock::now();
  try {
    pool_->plan();
  } catch (const OutOfMemoryError& e) {
    why_not_ = "the step's memory as a CUDA graph's does not fit: " + std::string(e.what());
    out_of_memory_ = true;
    return false;
  }
  const auto t_planned = std::chrono::steady_clock::now();
  void* graph = nullptr;
  pool_->set_capturing(true);
  std::string failure = captured(&graph);
  pool_->set_capturing(false);
  if (failure.empty()) failure = pool_->capture_mismatch();
  if (failure.empty()) {
    cudaGraphExec_t exec = nullptr;
    cudaError_t err = cudaGraphInstantiate(&exec, static_cast<cudaGraph_t>(graph), 0);
    if (err == cudaSuccess) {
      exec_ = exec;
    } else {
      (void)cudaGetLastError();
      failure = std::string("cannot instantiate the step's graph: ") + cudaGetErrorString(err);
    }
  }
  if (graph) cudaGraphDestroy(static_cast<cudaGraph_t>(graph));
  if (!failure.empty()) {
    why_not_ = "capturing it as a CUDA graph failed: " + failure;
    return false;
  }
  const auto ms = [](auto a, auto b) {
    return std::chrono::duration<double, std::milli>(b - a).count();
  };
  spdlog::info("the training step is a CUDA graph now ({} of memory for its tensors, which "
               "have {} live at once at most; traced in {:.1f} ms, laid out in {:.1f} ms, "
               "captured in {:.1f} ms)",
               format_bytes(pool_->held_bytes()), format_bytes(pool_->peak_live_bytes()),
               trace_ms_, ms(t_start, t_planned), ms(t_planned, std::chrono::steady_clock::now()));
  return true;
}

void StepGraph::launch() {
  LEASEHOLD_CUDA_CHECK(
      cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_), compute_stream(device_.index)));
  ++launches_;
}
#else
bool StepGraph::trace() {
  why_not_ = "this build has no CUDA";
  return false;
}
bool StepGraph::capture() { return false; }
std::string StepGraph::captured(void**) { return "this build has no CUDA"; }
void StepGraph::launch() { throw std::logic_error("StepGraph::launch without CUDA"); }
#endif

}  // namespace leasehold::engine
