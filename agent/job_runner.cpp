#include "agent/job_runner.h"

#include <spdlog/spdlog.h>

#include <optional>

#include "agent/engine/autocast.h"
#include "agent/engine/autograd.h"
#include "agent/engine/data.h"
#include "agent/engine/ops.h"
#include "agent/engine/optim.h"
#include "agent/gradient_reducer.h"
#include "agent/graphed_steps.h"
#include "agent/job_checkpoints.h"
#include "agent/job_data.h"
#include "agent/job_evaluation.h"
#include "agent/model_builder.h"
#include "agent/parameter_regions.h"
#include "agent/recompute_policy.h"
#include "agent/replica_store.h"
#include "shared/job_spec.h"
#include "shared/region_names.h"
#include "shared/units.h"

namespace leasehold {
namespace {

namespace E = engine;
using Clock = std::chrono::steady_clock;

std::unique_ptr<E::optim::Optimizer> make_optimizer(const proto::JobSpec& job,
                                                    const E::nn::NamedTensors& params) {
  const auto* o = job.optimizer();
  if (o && o->type() == proto::OptimizerType::SGD) {
    return std::make_unique<E::optim::SGD>(
        params, E::optim::SgdOptions{o->lr(), o->momentum(), o->weight_decay()});
  }
  E::optim::AdamOptions a;
  if (o) a = {o->lr(), o->beta1(), o->beta2(), o->eps(), o->weight_decay()};
  if (o && o->type() == proto::OptimizerType::AdamW) {
    a.decoupled = true;
    a.decay_matrices_only = true;
  }
  return std::make_unique<E::optim::Adam>(params, a);
}

// The learning rate of each step, when the job sets a schedule.
std::optional<E::optim::LrSchedule> make_schedule(const proto::JobSpec& job,
                                                      int64_t total_steps) {
  const auto* o = job.optimizer();
  if (!o || o->schedule() != proto::LrSchedule::Cosine) return std::nullopt;
  return E::optim::LrSchedule{o->lr(), o->min_lr(), o->warmup_steps(), total_steps};
}

// The seed of a replica's random numbers (dropout masks): with the step's
// number (StepRandom), all a step's masks depend on. Each replica draws its
// own; rank 0 those of a single run.
uint64_t replica_seed(uint64_t seed, int rank) {
  uint64_t z = seed + 0x9e3779b97f4a7c15ULL * static_cast<uint64_t>(rank + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Every replica's parameters at the end of epoch `epoch` are the same, or
// the job fails: the replicas must never silently train apart.
void check_replicas_agree(ReplicaStore& replicas, const std::vector<E::Tensor>& parameters,
                          int64_t epoch) {
  const std::string mine = GradientReducer::digest(parameters);
  const auto all =
      replicas.all_gather("digest/" + std::to_string(epoch), mine, std::chrono::hours(1));
  for (size_t r = 0; r < all.size(); ++r) {
    if (all[r] != all[0]) {
      throw std::runtime_error("the replicas' weights differ after epoch " +
                               std::to_string(epoch) + ": rank 0 has digest " + all[0] +
                               ", rank " + std::to_string(r) + " " + all[r]);
    }
  }
}

}  // namespace

JobResult run_job(const proto::JobSpec& job, const JobRunOptions& options) {
  auto t_start = Clock::now();
  // The files are checked as the data is read (or not at all when it is
  // resident in a region); the model against the data's shape below.
  validate_job(job, ValidationOptions{false, 0, JobLengthLimits::none()});
  const bool wants_regions = job.publish_parameters() || job.init_from();
  if (wants_regions && !options.session) {
    throw JobSpecError({"publish_parameters/init_from: shared cache regions need an agent with a "
                        "coordinator session"});
  }
  // A data-parallel job's rank 0 serves the replicas' rendezvous before
  // anything slow (the data, the model), so that it holds its port before
  // the others come asking.
  std::unique_ptr<ReplicaStore> replicas;
  if (options.replica.data_parallel()) {
    replicas = std::make_unique<ReplicaStore>(options.replica, options.replica_token,
                                              options.stopping);
  }
  JobData data = load_job_data(job, options.dataset_regions ? options.session : nullptr);
  const E::data::Dataset& train = data.train;
  const E::data::Dataset& test = data.test;
  const bool text = is_text_dataset(job);
  if (text) {
    validate_model(job, {train.context});
  } else {
    validate_model(job, {train.images.size(1), train.images.size(2), train.images.size(3)});
  }
  // A text corpus is a byte a token: on the GPU in the job's memory, so
  // that each batch is gathered there.
  E::data::Dataset text_train, text_test;
  if (text && options.device.is_cuda()) {
    text_train = train.to(options.device);
    text_test = test.to(options.device);
  }
  const E::data::Dataset& train_set = text_train.size() ? text_train : train;
  const E::data::Dataset& test_set = text_test.size() ? text_test : test;
  const auto t_data = Clock::now();
  E::manual_seed(job.seed());
  auto model = build_model(*job.model(), {E::DType::Float32, options.device});
  // Mixed precision for the whole run (training and evaluation); a no-op
  // on the CPU.
  std::optional<E::AutocastGuard> autocast;
  if (job.precision() == proto::Precision::BFloat16) autocast.emplace(E::DType::BFloat16);
  auto optimizer = make_optimizer(job, model->named_parameters());
  const auto t_model = Clock::now();
  std::optional<Clock::time_point> t_first_step;
  uint64_t first_step_leases = 0;  // leases its allocator held by then

  E::data::BatchIterator batches(train_set, job.batch_size(), true, job.seed());
  // A data-parallel replica trains on its slice of each global batch; rank
  // 0 alone evaluates, checkpoints, reports and publishes.
  const Replica& replica = options.replica;
  const bool lead = replica.rank == 0;
  if (replica.data_parallel()) batches.shard(replica.rank, replica.world_size);
  const int64_t per_epoch = batches.batches_per_epoch();
  const int64_t total_steps = job.steps() > 0 ? job.steps() : job.epochs() * per_epoch;
  const int64_t epochs = (total_steps + per_epoch - 1) / per_epoch;
  if (const auto schedule = make_schedule(job, total_steps)) optimizer->set_schedule(*schedule);
  const double clip = job.optimizer() ? job.optimizer()->clip_grad_norm() : 0;

  JobResult result;
  int64_t first_epoch = 0;
  JobCheckpoints checkpoints(job, options.file_system, options.checkpoint_owner);
  if (const auto resumed = checkpoints.resume(*model, *optimizer, options.device)) {
    first_epoch = resumed->epoch;
    result.resumed_from_epoch = first_epoch;
    // (The learning rate and the random numbers of a step come from this
    // count; a checkpoint's own agrees where it has one.)
    optimizer->set_steps(first_epoch * per_epoch);
    spdlog::info("job '{}' resumes after epoch {} from {}", job.name()->str(), first_epoch,
                 checkpoints.file());
    if (options.on_resume) options.on_resume(first_epoch);
    // The report of the checkpointed epoch again: the run that wrote the
    // checkpoint may have died before its report was delivered.
    if (resumed->last && options.on_epoch) options.on_epoch(*resumed->last);
  } else if (job.init_from()) {
    // A fresh start from published parameters (a checkpoint, above, wins).
    init_parameters(*options.session, parameters_region(job.init_from()->str()),
                    model->named_parameters(), job.name()->str());
  }

  // Saved tensors go through the spill manager for the whole run.
  std::optional<E::SavedTensorHooksGuard> spill_hooks;
  if (options.spill) {
    options.spill->keep_resident(model->parameters());
    spill_hooks.emplace(options.spill);
  }
  // What the step keeps in page-locked host memory by plan (the blocks'
  // inputs, the optimizer's state: below) comes out of the spill store's
  // host tier, with what it spills there (agent/spill/host_tier.h); a job
  // whose store has no host tier keeps none.
  const std::shared_ptr<E::Allocator> planned_host =
      options.spill ? options.spill->host_allocator() : nullptr;
  std::optional<E::PinnedHostGuard> planned_host_guard;
  if (planned_host) planned_host_guard.emplace(planned_host);
  // Over its memory budget, the job's transformer blocks recompute in
  // backward before its activations spill (recompute_policy.h).
  // Its last step: the optimizer's state to host memory, an eighth of it
  // at each step more (whole parameters, in order), so that the update
  // reads over the host link only the part the budget cannot hold, for a
  // job that may spill to a host tier (the state comes out of it, above).
  // A graph held then has the state's device addresses in it: it goes
  // first, and is made again later (the gradients in its pool with it).
  constexpr uint64_t kStateParts = 8;
  GraphedSteps* graphed = nullptr;
  // Then its blocks' inputs to host memory, planned copies overlapped with
  // the step (a CUDA job's with a host tier, which they come out of).
  RecomputePolicy recompute(
      *model, options.spill,
      [&]() -> bool {
        if (!planned_host) return false;
        // (Nothing left to move: the graph stays.)
        const uint64_t state = optimizer->gpu_parameters_state_bytes();
        if (optimizer->host_state_bytes() >= state) return false;
        if (graphed && graphed->holds_graph()) {
          graphed->forget();
          optimizer->zero_grad();
        }
        return optimizer->move_state_to_host((state + kStateParts - 1) / kStateParts);
      },
      /*offload=*/planned_host && options.device.is_cuda(), [&] {
        return "and " + format_bytes(optimizer->host_state_bytes()) + " of the optimizer's " +
               format_bytes(optimizer->gpu_parameters_state_bytes()) +
               " of state is in host memory";
      });
  // The replicas connect, and from here on every step's gradients are
  // averaged over them.
  std::unique_ptr<GradientReducer> reducer;
  if (replicas) {
    reducer = GradientReducer::connect(*replicas, options.device, model->parameters(),
                                       options.stopping);
    spdlog::info("job '{}': replica {} of {} connected", job.name()->str(), replica.rank,
                 replica.world_size);
  }
  auto allocator = E::current_allocator(options.device);
  auto fill_memory = [&](JobProgress& p) {
    E::AllocatorStats a = allocator->stats();
    p.peak_device_bytes = a.peak_leased_bytes ? a.peak_leased_bytes : a.peak_in_use_bytes;
    if (options.spill) {
      spill::SpillStats s = options.spill->store_stats();
      p.spill_host_bytes = s.host_bytes;
      p.spill_file_bytes = s.file_bytes;
      p.spilled_bytes = s.bytes_out;
      p.restored_bytes = s.bytes_in;
    }
  };

  // On a GPU a bad label is counted on the device and read when progress is
  // reported and at the end of each epoch, not every step (each read waits
  // for the device). On the CPU it is caught at once.
  std::optional<E::DeferredLabelCheck> label_check;
  if (options.device.is_cuda()) label_check.emplace(options.device);
  // One training step on a batch. Its loss stays on the device; nothing
  // in it waits for the host, so that it can be captured as a CUDA graph.
  const uint64_t random_seed = replica_seed(job.seed(), replica.rank);
  const std::vector<E::Tensor> product_parameters = model->product_parameters();
  auto train_step = [&](const E::Tensor& x, const E::Tensor& y) {
    E::StepRandom random(random_seed, optimizer->step_counter());
    optimizer->zero_grad();
    E::Tensor loss;
    {
      // Under autocast, the weights' bfloat16 copies made once for the
      // forward pass; backward keeps those its products saved.
      E::AutocastWeights weight_copies(product_parameters);
      {
        // (The logits live as long as the loss's backward keeps them, not
        // through the whole backward pass: the GPT job's are 16 MiB.)
        const E::Tensor logits = (*model)(x);
        weight_copies.release();
        loss = batch_loss(logits, y);
      }
      if (reducer) {
        // Buckets of gradients are averaged while backward goes on.
        E::GradientReadyGuard reduce(reducer->hook());
        loss.backward();
        reducer->end_step();
      } else {
        loss.backward();
      }
    }
    if (clip > 0) E::optim::clip_grad_norm(model->named_parameters(), clip);
    optimizer->step();
    return loss;
  };
  // Whole steps as CUDA graphs where they can be (graphed_steps.h).
  GraphedSteps steps(options.device, train_step,
                     {.enabled = options.cuda_graphs && options.device.is_cuda() && !reducer,
                      .full_batch = job.batch_size(),
                      .need_less =
                          [&](const std::string& why) {
                            if (!recompute.tighten()) return false;
                            spdlog::info("job '{}': {} ({}); {} from now on", job.name()->str(),
                                         recompute.reason(RecomputePolicy::Step::GraphDidNotFit),
                                         why, recompute.describe());
                            return true;
                          },
                      .release = [&optimizer] { optimizer->zero_grad(); }});
  graphed = &steps;
  // For a Shrink: the graph's pool (and the gradients in it) back to the
  // allocator.
  auto drop_graph = [&] {
    steps.drop();
    optimizer->zero_grad();
    spdlog::info("job '{}': the step's CUDA graph dropped to give memory back; steps run op by op "
                 "from now on", job.name()->str());
  };

  JobProgress last_progress;  // the last one reported
  int64_t global = first_epoch * per_epoch, samples = 0;
  double train_seconds = 0;
  for (int64_t epoch = first_epoch; epoch < epochs && global < total_steps; ++epoch) {
    auto t_epoch = Clock::now();
    auto last_report = t_epoch;
    batches.start_epoch(epoch);
    E::Tensor x, y;
    int64_t step = 0, since_report = 0, samples_since = 0;
    double reported_sum = 0, epoch_loss = 0;
    // Losses are summed on the device and read back only when reported, so
    // the loop does not wait for the GPU every step. One sum for the whole
    // epoch: its value does not depend on when progress happened to be
    // reported (a run slowed down reports the same epoch loss).
    E::Tensor loss_acc = E::zeros({}, {E::DType::Float32, options.device});
    // A held graph's batch is gathered straight into its inputs; else into
    // new tensors (the last step's may still be saved somewhere).
    const auto next_batch = [&] {
      x = y = E::Tensor();
      steps.input_tensors(x, y);
      return batches.next(x, y, options.device, /*into=*/x.defined());
    };
    while (global < total_steps && next_batch()) {
      if (options.should_stop && options.should_stop()) throw JobCancelled();
      if (steps.holds_graph() && options.memory_wanted && options.memory_wanted()) drop_graph();
      if (options.at_step_boundary) options.at_step_boundary();
      if (!t_first_step) {
        t_first_step = Clock::now();
        first_step_leases = allocator->stats().leases;
        if (options.on_first_step) options.on_first_step(unix_time_us());
      }
      // A step that ran out of memory runs again with more recomputed
      // (recompute_policy.h: run_step), unless it changed what the next
      // reads (the optimizer had begun) or peers wait in the same step.
      E::Tensor loss;
      const int retries = recompute.run_step(
          [&] { loss = steps.run(x, y); },
          [&] {
            if (reducer) return false;
            if (options.spill) options.spill->end_step();  // (the failed attempt's spills ended)
            return optimizer->steps() == global;
          },
          [&](const E::OutOfMemoryError& e) {
            spdlog::warn("job '{}': the step ran out of memory ({}); it runs again, and {} "
                         "from now on",
                         job.name()->str(), e.what(), recompute.describe());
          });
      if (retries > 0) steps.retry();
      if (options.spill) options.spill->end_step();
      // (A graph replays the step it captured: what the policy changes
      // waits until steps run op by op again.) One step more when the step
      // spilled, or when its graph did not fit; either way the step needs
      // less now, and a graph may be tried again. A step that spilled op
      // by op before its graph was tried takes none: the graph's arena
      // may fit where the step op by op spills (graphed_steps.h).
      if (!steps.holds_graph() && !steps.graph_pending()) {
        const RecomputePolicy::Step why = recompute.after_step(steps.graph_did_not_fit());
        if (why != RecomputePolicy::Step::None) {
          steps.retry();
          spdlog::info("job '{}': {}; {} from now on", job.name()->str(), recompute.reason(why),
                       recompute.describe());
        }
      }
      {
        E::NoGradGuard ng;
        loss_acc = E::add(loss_acc, loss.detach());
      }
      ++step;
      ++global;
      ++since_report;
      // (Every replica trains as many samples a step; a text job's samples
      // are its tokens.)
      const int64_t trained = (text ? x.numel() : x.size(0)) * replica.world_size;
      samples_since += trained;
      samples += trained;
      bool epoch_end = step == per_epoch || global == total_steps;
      auto now = Clock::now();
      if (lead && options.on_progress &&
          (now - last_report >= options.progress_interval || epoch_end)) {
        if (label_check) label_check->check();
        double sum = loss_acc.item();
        double acc = sum - reported_sum;
        reported_sum = sum;
        // (Timed once the device has finished the steps: the host queues
        // steps ahead of the device, CUDA graphs far ahead.)
        now = Clock::now();
        double secs = std::chrono::duration<double>(now - last_report).count();
        JobProgress p;
        p.epoch = epoch + 1;
        p.epochs = epochs;
        p.step = step;
        p.steps_in_epoch = per_epoch;
        p.global_step = global;
        p.total_steps = total_steps;
        p.loss = acc / since_report;
        p.samples_per_second = secs > 0 ? samples_since / secs : 0;
        const double per_step = double(job.batch_size()) * (text ? double(x.size(1)) : 1.0);
        p.eta_seconds =
            p.samples_per_second > 0 ? (total_steps - global) * per_step / p.samples_per_second : 0;
        fill_memory(p);
        options.on_progress(p);
        last_progress = p;
        since_report = 0;
        samples_since = 0;
        last_report = now;
      }
    }
    if (label_check) label_check->check();
    epoch_loss = step ? loss_acc.item() / step : 0;
    double epoch_seconds = std::chrono::duration<double>(Clock::now() - t_epoch).count();
    train_seconds += epoch_seconds;
    // (The last step's gradients are read by nothing more: their memory,
    // and a CUDA graph's idle arena with it, may go to the evaluation.)
    optimizer->zero_grad();
    const Evaluation eval = lead ? evaluate(*model, test_set, options.device, text) : Evaluation{};
    EpochReport report{epoch + 1, epoch_loss, eval.accuracy, epoch_seconds, false, eval.loss};
    if (lead && checkpoints.due(epoch + 1, epochs)) {
      checkpoints.write(report, *model, *optimizer);
      report.checkpointed = true;
    }
    // (After rank 0's evaluation and checkpoint, so that this is also where
    // the others wait for them, in the rendezvous rather than in an
    // all-reduce with a timeout.)
    if (replicas) check_replicas_agree(*replicas, model->parameters(), epoch + 1);
    result.epochs.push_back(report);
    if (lead && options.on_epoch) options.on_epoch(report);
  }
  if (replicas) replicas->finish();
  if (lead && job.publish_parameters()) {
    publish_parameters(*options.session, parameters_region(job.publish_parameters()->str()),
                       model->named_parameters(), job.name()->str());
  }
  result.steps = global;
  result.graph_steps = steps.graph_steps();
  if (steps.releases()) {
    spdlog::info("job '{}': the step's CUDA graph gave its memory up to other tensors {} times",
                 job.name()->str(), steps.releases());
  }
  result.recomputed_mlps = recompute.mlps();
  result.recomputed_blocks_but_attention = recompute.but_attention();
  result.recomputed_blocks = recompute.whole();
  result.recomputed_halves = recompute.halves();
  result.recomputed_blocks_in_halves = recompute.blocks_in_halves();
  result.optimizer_state_on_host = recompute.took_last_step();
  result.optimizer_state_host_bytes = optimizer->host_state_bytes();
  result.offloaded_blocks = recompute.offloaded_in_host_memory();
  if (const int short_of_memory = recompute.offloads_short_of_memory()) {
    spdlog::warn("job '{}': {} of the {} blocks set to keep their input in host memory kept it "
                 "on the device at least once: the job's host tier had no room for it",
                 job.name()->str(), short_of_memory, recompute.offloaded());
  }
  result.mlp_slices = recompute.mlp_slices();
  result.sliced_mlps = recompute.sliced_mlps();
  result.memory = last_progress;
  fill_memory(result.memory);
  if (options.spill && result.memory.spilled_bytes) {
    // Where a spilling job's time may go besides its copies: pages moved
    // in its window, each move after waiting for the device.
    const E::AllocatorStats a = allocator->stats();
    const spill::SpillCounters c = options.spill->counters();
    spdlog::info("job '{}': {} evictions, {} restores ({} ahead of need), {} reclaims; "
                 "{} pages shown, {} times idle pages hidden",
                 job.name()->str(), c.evictions, c.restores, c.prefetched, c.reclaims,
                 a.pages_mapped, a.trims);
  }
  result.test_accuracy = !lead ? 0
                         : result.epochs.empty()
                             ? evaluate(*model, test_set, options.device, text).accuracy
                             : result.epochs.back().test_accuracy;
  result.samples_per_second = train_seconds > 0 ? samples / train_seconds : 0;
  result.seconds = std::chrono::duration<double>(Clock::now() - t_start).count();
  // Where a job's start goes: the dataset (decoded, or resident in its
  // region), the model, and the first step's batch.
  auto ms = [](Clock::time_point a, Clock::time_point b) {
    return std::chrono::duration<double, std::milli>(b - a).count();
  };
  spdlog::info("job '{}': dataset {:.2f} ms ({}), model {:.2f} ms, first step began {:.2f} ms after "
               "the start ({} leases by then), {:.0f} ms in all",
               job.name()->str(), ms(t_start, t_data),
               data.region.empty() ? "decoded privately: " + data.private_because
               : data.decoded      ? "decoded into region " + data.region
                                   : "resident in region " + data.region,
               ms(t_data, t_model), t_first_step ? ms(t_start, *t_first_step) : 0.0,
               first_step_leases, ms(t_start, Clock::now()));
  return result;
}

}  // namespace leasehold
