#include "coordinator/file_workers.h"

#include <spdlog/spdlog.h>

#include <cerrno>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <mutex>
#include <thread>
#include <variant>

#include "shared/checkpoint_folder.h"
#include "shared/job_spec.h"

namespace leasehold {

namespace {

// One-MiB pieces: far below the protocol's message size.
constexpr size_t kCheckpointPieceBytes = 1u << 20;

FileWorkers::ReadResult read_piece(const CheckpointRead& r) {
  FileWorkers::ReadResult out;
  out.token = r.token;
  try {
    // Opened as the agents open it: no link anywhere on the way, the
    // folder's owner checked.
    CheckpointFolder folder(r.dir, r.owner, /*create=*/false);
    Status st = folder.read_range(r.name, r.offset, kCheckpointPieceBytes, &out.data, &out.total,
                                  &out.version);
    out.ok = st.ok();
    out.missing = st.is_not_found() || st.error_number() == ENOENT;
    if (!st.ok()) out.error = st.message();
  } catch (const std::system_error& e) {
    out.missing = e.code() == std::errc::no_such_file_or_directory;
    out.error = e.what();
  } catch (const std::exception& e) {
    out.refused = true;
    out.error = e.what();
  }
  return out;
}

}  // namespace

struct FileWorkers::State {
  std::mutex mu;
  std::condition_variable cv;
  // A check, a checkpoint read, or a folder to remove.
  std::deque<std::variant<FileCheck, CheckpointRead, std::string>> work;
  std::vector<CheckResult> results;
  std::vector<ReadResult> reads;
  bool stop = false;
  size_t running = 0;  // threads not yet finished
  std::function<void()> notify;

  void serve() {
    while (true) {
      std::variant<FileCheck, CheckpointRead, std::string> item;
      {
        std::unique_lock lock(mu);
        cv.wait(lock, [&] { return stop || !work.empty(); });
        // Checks and reads are dropped at shutdown (nobody waits for
        // them); folder removals are still done.
        while (stop && !work.empty() && !std::holds_alternative<std::string>(work.front())) {
          work.pop_front();
        }
        if (work.empty()) break;
        item = std::move(work.front());
        work.pop_front();
      }
      if (auto* c = std::get_if<FileCheck>(&item)) {
        CheckResult r{c->token, {}};
        try {
          validate_job(*c->spec, c->validation);
        } catch (const JobSpecError& e) {
          r.problems = e.problems();
        } catch (const std::exception& e) {
          r.problems = {e.what()};
        }
        std::lock_guard lock(mu);
        results.push_back(std::move(r));
        // Under the lock: the owner clears `notify` before what it wakes goes.
        if (notify) notify();
      } else if (auto* r = std::get_if<CheckpointRead>(&item)) {
        ReadResult result = read_piece(*r);
        std::lock_guard lock(mu);
        reads.push_back(std::move(result));
        if (notify) notify();
      } else {
        std::error_code ec;
        std::filesystem::remove_all(std::get<std::string>(item), ec);
        if (ec) spdlog::warn("cannot remove {}: {}", std::get<std::string>(item), ec.message());
      }
    }
    std::lock_guard lock(mu);
    --running;
    cv.notify_all();
  }
};

FileWorkers::FileWorkers(size_t threads, std::function<void()> notify)
    : state_(std::make_shared<State>()) {
  state_->notify = std::move(notify);
  state_->running = threads;
  for (size_t i = 0; i < threads; ++i) {
    // Each thread keeps the state alive: a thread stuck in a read outlives us.
    std::thread([s = state_] { s->serve(); }).detach();
  }
}

FileWorkers::~FileWorkers() {
  std::unique_lock lock(state_->mu);
  state_->stop = true;
  state_->notify = nullptr;  // a worker stuck in I/O must not wake a closed fd later
  state_->cv.notify_all();
  if (!state_->cv.wait_for(lock, std::chrono::seconds(2), [&] { return state_->running == 0; })) {
    spdlog::warn("{} file worker(s) still busy (a hung file system?); not waiting for them",
                 state_->running);
  }
}

void FileWorkers::check(FileCheck check) {
  std::lock_guard lock(state_->mu);
  state_->work.emplace_back(std::move(check));
  state_->cv.notify_one();
}

void FileWorkers::read(CheckpointRead read) {
  std::lock_guard lock(state_->mu);
  state_->work.emplace_back(std::move(read));
  state_->cv.notify_one();
}

std::vector<FileWorkers::ReadResult> FileWorkers::take_reads() {
  std::lock_guard lock(state_->mu);
  return std::exchange(state_->reads, {});
}

void FileWorkers::remove_dir(std::string dir) {
  std::lock_guard lock(state_->mu);
  state_->work.emplace_back(std::move(dir));
  state_->cv.notify_one();
}

std::vector<FileWorkers::CheckResult> FileWorkers::take_results() {
  std::lock_guard lock(state_->mu);
  return std::exchange(state_->results, {});
}

}  // namespace leasehold
