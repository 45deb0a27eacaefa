#include "coordinator/file_workers.h"

#include <spdlog/spdlog.h>

#include <condition_variable>
#include <deque>
#include <filesystem>
#include <mutex>
#include <thread>
#include <variant>

#include "shared/job_spec.h"

namespace leasehold {

struct FileWorkers::State {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::variant<FileCheck, std::string>> work;  // a check, or a folder to remove
  std::vector<CheckResult> results;
  bool stop = false;
  size_t running = 0;  // threads not yet finished
  std::function<void()> notify;

  void serve() {
    while (true) {
      std::variant<FileCheck, std::string> item;
      {
        std::unique_lock lock(mu);
        cv.wait(lock, [&] { return stop || !work.empty(); });
        // Checks are dropped at shutdown (nobody waits for them); folder
        // removals are still done.
        while (stop && !work.empty() && std::holds_alternative<FileCheck>(work.front())) {
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
