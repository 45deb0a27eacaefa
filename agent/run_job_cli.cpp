#include "agent/run_job_cli.h"

#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "agent/engine/allocator.h"
#include "agent/job_runner.h"
#include "agent/lease_allocator.h"
#include "shared/job_spec.h"
#include "shared/units.h"

namespace leasehold {

int run_job_file(AgentSession& session, const std::string& path, const RunJobOverrides& ov,
                 const std::atomic<bool>& stop, spill::AgentSpill* spill) {
  std::vector<uint8_t> buffer;
  try {
    std::ifstream in(path);
    if (!in) throw JobSpecError({"cannot read job file " + path});
    std::stringstream text;
    text << in.rdbuf();
    buffer = parse_job_json(text.str(), path);
    if (ov.epochs > 0 || ov.train_limit >= 0 || ov.test_limit >= 0) {
      // Unpack, change, pack again: the object API sets fields the file omitted.
      std::unique_ptr<proto::JobSpecT> obj(verify_job(buffer)->UnPack());
      if (ov.epochs > 0) {
        obj->epochs = static_cast<int32_t>(ov.epochs);
        obj->steps = 0;
      }
      if (!obj->dataset) obj->dataset = std::make_unique<proto::DatasetSpecT>();
      if (ov.train_limit >= 0) obj->dataset->train_limit = static_cast<int32_t>(ov.train_limit);
      if (ov.test_limit >= 0) obj->dataset->test_limit = static_cast<int32_t>(ov.test_limit);
      flatbuffers::FlatBufferBuilder fbb;
      fbb.Finish(proto::JobSpec::Pack(fbb, obj.get()));
      buffer.assign(fbb.GetBufferPointer(), fbb.GetBufferPointer() + fbb.GetSize());
    }
    validate_job(*verify_job(buffer), ValidationOptions{true, session.pool().size});
  } catch (const JobSpecError& e) {
    std::fprintf(stderr, "leasehold-agent: %s\n", e.what());
    return 2;
  }
  const proto::JobSpec& job = *verify_job(buffer);
  PoolDescriptor pool = session.pool();
  std::string device = job.device() ? job.device()->str() : "auto";
  const std::string wants = parse_job_device(device).value_or(JobDevice{}).backend;
  bool pool_is_cuda = pool.backend == Backend::Cuda;
  if ((wants == "cuda" && !pool_is_cuda) || (wants == "cpu" && pool_is_cuda)) {
    std::fprintf(stderr, "leasehold-agent: job wants device %s but this agent's pool is on %s\n",
                 device.c_str(), backend_name(pool.backend));
    return 2;
  }

  LeaseAllocatorOptions lo =
      LeaseAllocatorOptions::for_budget(job_memory_budget(job, session.pool().size));
  auto leases = std::make_shared<LeaseAllocator>(session, lo);
  engine::AllocatorGuard guard(leases);

  JobRunOptions opts;
  opts.device = leases->device();
  opts.session = &session;
  opts.cuda_graphs = ov.cuda_graphs;
  if (spill) opts.spill = spill->for_job(job, "run-job", leases);
  opts.should_stop = [&stop] { return stop.load(); };
  opts.on_progress = [](const JobProgress& p) {
    std::printf("progress epoch=%lld/%lld step=%lld/%lld loss=%.4f samples_per_s=%.0f eta_s=%.0f\n",
                (long long)p.epoch, (long long)p.epochs, (long long)p.step,
                (long long)p.steps_in_epoch, p.loss, p.samples_per_second, p.eta_seconds);
    std::fflush(stdout);
  };
  opts.on_epoch = [](const EpochReport& r) {
    std::printf("epoch %lld: train_loss=%.4f test_accuracy=%.2f%% seconds=%.1f", (long long)r.epoch,
                r.train_loss, 100 * r.test_accuracy, r.seconds);
    if (r.validation_loss > 0) {
      std::printf(" validation_loss=%.4f bits_per_byte=%.3f", r.validation_loss,
                  r.validation_loss / std::log(2.0));
    }
    std::printf("\n");
    std::fflush(stdout);
  };
  try {
    JobResult r = run_job(job, opts);
    std::printf(
        "result job=%s test_accuracy=%.2f%% samples_per_s=%.0f steps=%lld seconds=%.1f "
        "peak_memory=%s spilled=%s restored=%s recomputed_mlps=%d "
        "recomputed_blocks_but_attention=%d recomputed_blocks=%d recomputed_halves=%d "
        "recomputed_blocks_in_halves=%d "
        "optimizer_state_on_host=%d optimizer_state_host_bytes=%llu offloaded_blocks=%d "
        "mlp_slices=%d sliced_mlps=%d\n",
        job.name()->c_str(), 100 * r.test_accuracy, r.samples_per_second, (long long)r.steps,
        r.seconds, format_bytes(r.memory.peak_device_bytes).c_str(),
        format_bytes(r.memory.spilled_bytes).c_str(),
        format_bytes(r.memory.restored_bytes).c_str(), r.recomputed_mlps,
        r.recomputed_blocks_but_attention, r.recomputed_blocks, r.recomputed_halves,
        r.recomputed_blocks_in_halves,
        r.optimizer_state_on_host ? 1 : 0, (unsigned long long)r.optimizer_state_host_bytes,
        r.offloaded_blocks, r.mlp_slices, r.sliced_mlps);
    std::fflush(stdout);
    return 0;
  } catch (const JobCancelled&) {
    std::printf("result job=%s cancelled\n", job.name()->c_str());
    return 130;
  } catch (const std::exception& e) {
    std::printf("result job=%s failed: %s\n", job.name()->c_str(), e.what());
    std::fflush(stdout);
    return 1;
  }
}

}  // namespace leasehold
