#include "agent/job_checkpoints.h"

#include <cerrno>
#include <map>
#include <stdexcept>
#include <system_error>
#include <utility>

#include "agent/engine/checkpoint.h"
#include "shared/job_spec.h"

namespace leasehold {

namespace E = engine;

JobCheckpoints::JobCheckpoints(const proto::JobSpec& job, FileSystem* file_system,
                               CheckpointOwner owner)
    : job_(job), file_system_(file_system), owner_(std::move(owner)), file_(checkpoint_file(job)) {}

bool JobCheckpoints::due(int64_t epoch, int64_t epochs) const {
  return enabled() && (epoch % job_.checkpoint()->every_epochs() == 0 || epoch == epochs);
}

FileSystem* JobCheckpoints::open(bool write) {
  if (file_system_) return file_system_;
  const std::string what = std::string(write ? "cannot write checkpoint " : "cannot resume from ");
  try {
    folder_ = std::make_unique<CheckpointFolder>(job_.checkpoint()->directory()->str(), owner_,
                                                 write);
  } catch (const std::system_error& e) {
    if (e.code().value() != ENOENT) throw std::runtime_error(what + file_ + ": " + e.what());
    if (!write) return nullptr;
    throw std::runtime_error(what + file_ + ": the folder " + e.what() + " does not exist");
  } catch (const std::exception& e) {
    throw std::runtime_error(what + file_ + ": " + e.what());
  }
  return folder_.get();
}

std::optional<JobCheckpoints::Resumed> JobCheckpoints::resume(E::nn::Module& model,
                                                              E::optim::Optimizer& optimizer,
                                                              E::Device device) {
  if (!enabled()) return std::nullopt;
  FileSystem* fs = open(false);
  if (!fs || !fs->exists(file_)) return std::nullopt;
  // Parameters and optimizer state, and their names: never more than the
  // job's resident bytes (which count gradients too) and some headers.
  const uint64_t resident = job_resident_bytes(job_);
  auto loaded = E::checkpoint::load(
      file_, *fs, resident > UINT64_MAX - (16u << 20) ? UINT64_MAX : resident + (16u << 20));
  std::map<std::string, E::Tensor> by_name(loaded.begin(), loaded.end());
  E::checkpoint::restore(loaded, model.named_parameters());
  E::nn::NamedTensors opt_state;
  for (auto& [name, t] : loaded) {
    if (name.rfind("sgd.", 0) == 0 || name.rfind("adam.", 0) == 0) {
      opt_state.emplace_back(name, t.to(device));
    }
  }
  optimizer.load_state(opt_state);
  auto epoch_it = by_name.find("job.epoch");
  if (epoch_it == by_name.end()) {
    throw std::runtime_error(file_ + " is not a job checkpoint (it has no job.epoch)");
  }
  Resumed r;
  r.epoch = static_cast<int64_t>(epoch_it->second.item());
  if (auto it = by_name.find("job.last_epoch");
      it != by_name.end() && (it->second.numel() == 4 || it->second.numel() == 5)) {
    auto v = it->second.to_vector<double>();
    r.last = EpochReport{static_cast<int64_t>(v[0]), v[1], v[2], v[3], true,
                         v.size() == 5 ? v[4] : 0.0};
  }
  return r;
}

void JobCheckpoints::write(const EpochReport& report, const E::nn::Module& model,
                           const E::optim::Optimizer& optimizer) {
  FileSystem& fs = *open(true);
  if (Status st = fs.create_dirs(job_.checkpoint()->directory()->str()); !st.ok()) {
    throw std::runtime_error("cannot write checkpoint " + file_ + ": " + st.to_string());
  }
  E::nn::NamedTensors state = model.named_parameters();
  for (auto& kv : optimizer.state()) state.push_back(kv);
  state.emplace_back("job.epoch", E::from_vector<int64_t>({report.epoch}, {1}));
  state.emplace_back("job.last_epoch",
                     E::from_vector<double>({double(report.epoch), report.train_loss,
                                             report.test_accuracy, report.seconds,
                                             report.validation_loss},
                                            {5}));
  E::checkpoint::save(file_, state, fs);
}

}  // namespace leasehold
