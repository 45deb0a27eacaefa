#include "client/job_format.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <sstream>

#include "shared/interruption.h"
#include "shared/protocol.h"
#include "shared/units.h"

namespace leasehold {
namespace {

uint64_t now_ms() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count());
}

std::string age(uint64_t since_ms) {
  uint64_t s = (now_ms() - std::min(since_ms, now_ms())) / 1000;
  char buf[32];
  if (s < 120) {
    std::snprintf(buf, sizeof buf, "%llus", (unsigned long long)s);
  } else if (s < 7200) {
    std::snprintf(buf, sizeof buf, "%llum", (unsigned long long)(s / 60));
  } else {
    std::snprintf(buf, sizeof buf, "%lluh", (unsigned long long)(s / 3600));
  }
  return buf;
}

// How many attempts a job has had: the latest one's number (a summary
// carries only the latest attempts).
unsigned attempt_count(const proto::JobInfo& j) {
  return j.attempts() && j.attempts()->size() ? j.attempts()->Get(j.attempts()->size() - 1)->number()
                                              : 0u;
}

// Interruptions of all its attempts (a summary holds only the latest).
unsigned interruption_count(const proto::JobInfo& j) {
  unsigned n = 0;
  if (j.interruptions()) {
    for (const auto* c : *j.interruptions()) n += c->count();
  }
  return n;
}

// "2 agent died, 1 coordinator restarted" (empty: none).
std::string interruption_words(const proto::JobInfo& j) {
  std::string out;
  if (!j.interruptions()) return out;
  for (const auto* c : *j.interruptions()) {
    if (c->count() == 0) continue;
    const std::string name(str(c->cause()));
    auto cause = interruption_from_name(name);
    out += (out.empty() ? "" : ", ") + std::to_string(c->count()) + " " +
           (cause ? std::string(leasehold::interruption_words(*cause)) : name);
  }
  return out;
}

std::string when(uint64_t at_ms) {
  std::time_t t = static_cast<std::time_t>(at_ms / 1000);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S", std::localtime(&t));
  return buf;
}

std::string short_progress(const proto::JobInfo& j) {
  const auto* p = j.progress();
  std::string state(job_state_text(j));
  char buf[64];
  if (state == "succeeded") {
    // A program job (it has an exit status) may report no accuracy at all.
    if (j.exit_code() >= 0 && j.test_accuracy() == 0) return "exit 0";
    std::snprintf(buf, sizeof buf, "test acc %.2f%%", 100 * j.test_accuracy());
    return buf;
  }
  if (p && p->total_steps() == 0 && p->global_step() > 0) {  // a program's reports
    std::snprintf(buf, sizeof buf, "step %lld, loss %.4g", (long long)p->global_step(), p->loss());
    return buf;
  }
  if (!p || p->total_steps() == 0) return "-";
  std::snprintf(buf, sizeof buf, "epoch %d/%d %3.0f%%", p->epoch(), p->epochs(),
                100.0 * p->global_step() / p->total_steps());
  return buf;
}

}  // namespace

std::string result_summary(const proto::JobInfo& j) {
  char buf[128];
  if (j.exit_code() >= 0 && j.test_accuracy() == 0) {  // a program that reported no accuracy
    std::snprintf(buf, sizeof buf, "exit status %d", j.exit_code());
    std::string out = buf;
    if (j.samples_per_second() > 0) {
      std::snprintf(buf, sizeof buf, ", %.0f samples/s", j.samples_per_second());
      out += buf;
    }
    return out;
  }
  std::snprintf(buf, sizeof buf, "test accuracy %.2f%%, %.0f samples/s", 100 * j.test_accuracy(),
                j.samples_per_second());
  return buf;
}

nlohmann::json job_to_json(const proto::JobInfo& j) {
  nlohmann::json out{{"id", j.id()},
                     {"name", std::string(str(j.name()))},
                     {"state", job_state_text(j)},
                     {"agent", std::string(str(j.agent()))},
                     {"priority", j.priority()},
                     {"submitted_ms", j.submitted_ms()},
                     {"reason", std::string(str(j.reason()))},
                     {"test_accuracy", j.test_accuracy()},
                     {"samples_per_second", j.samples_per_second()},
                     {"attempts", attempt_count(j)},
                     {"max_attempts", j.max_attempts()},
                     {"resumed_from_epoch", j.resumed_from_epoch()},
                     {"checkpoint", std::string(str(j.checkpoint()))},
                     {"cancel_requested", j.cancel_requested()},
                     {"finished_ms", j.finished_ms()},
                     {"epochs_total", j.epochs_total()},
                     {"history_total", j.history_total()},
                     {"memory_wait_ms", j.memory_wait_ms()},
                     {"shrinks", j.shrinks()},
                     {"shrunk_bytes", j.shrunk_bytes()},
                     {"waiting_for", std::string(str(j.waiting_for()))},
                     {"assigned_at_us", j.assigned_at_us()},
                     {"first_step_at_us", j.first_step_at_us()},
                     {"submitted_by", std::string(str(j.submitted_by()))},
                     {"cancelled_by", std::string(str(j.cancelled_by()))}};
  out["interruptions"] = nlohmann::json::object();
  if (j.interruptions()) {
    for (const auto* c : *j.interruptions()) {
      out["interruptions"][std::string(str(c->cause()))] = c->count();
    }
  }
  out["attempt_history"] = nlohmann::json::array();
  if (j.attempts()) {
    for (const auto* a : *j.attempts()) {
      nlohmann::json replicas = nlohmann::json::array();
      if (a->replica_agents()) {
        for (const auto* r : *a->replica_agents()) replicas.push_back(r->str());
      }
      out["attempt_history"].push_back({{"number", a->number()},
                                        {"replica_agents", std::move(replicas)},
                                        {"agent", std::string(str(a->agent()))},
                                        {"started_ms", a->started_ms()},
                                        {"ended_ms", a->ended_ms()},
                                        {"outcome", std::string(str(a->outcome()))},
                                        {"reason", std::string(str(a->reason()))},
                                        {"resumed_from_epoch", a->resumed_from_epoch()},
                                        {"cause", std::string(str(a->cause()))}});
    }
  }
  out["history"] = nlohmann::json::array();
  if (j.history()) {
    for (const auto* h : *j.history()) {
      out["history"].push_back({{"state", job_state_text(*h)},
                                {"at_ms", h->at_ms()},
                                {"reason", std::string(str(h->reason()))}});
    }
  }
  if (const auto* p = j.progress()) {
    out["progress"] = {{"epoch", p->epoch()},
                       {"epochs", p->epochs()},
                       {"step", p->step()},
                       {"steps_in_epoch", p->steps_in_epoch()},
                       {"global_step", p->global_step()},
                       {"total_steps", p->total_steps()},
                       {"loss", p->loss()},
                       {"samples_per_second", p->samples_per_second()},
                       {"eta_seconds", p->eta_seconds()},
                       {"peak_device_bytes", p->peak_device_bytes()},
                       {"spill_host_bytes", p->spill_host_bytes()},
                       {"spill_file_bytes", p->spill_file_bytes()},
                       {"spilled_bytes", p->spilled_bytes()},
                       {"restored_bytes", p->restored_bytes()}};
  }
  out["epochs"] = nlohmann::json::array();
  if (j.epochs()) {
    for (const auto* e : *j.epochs()) {
      out["epochs"].push_back({{"epoch", e->epoch()},
                               {"train_loss", e->train_loss()},
                               {"test_accuracy", e->test_accuracy()},
                               {"seconds", e->seconds()}});
      if (e->validation_loss() > 0) {
        out["epochs"].back()["validation_loss"] = e->validation_loss();
        out["epochs"].back()["validation_bits_per_byte"] = e->validation_loss() / std::log(2.0);
      }
    }
  }
  if (const auto* s = j.spec(); s && s->program()) {
    const auto* prog = s->program();
    nlohmann::json command = nlohmann::json::array();
    if (prog->command()) {
      for (const auto* a : *prog->command()) command.push_back(a->str());
    }
    out["spec"] = {{"program", {{"command", command},
                                {"directory", std::string(str(prog->directory()))}}},
                   {"memory_budget", std::string(str(s->memory_budget()))},
                   {"memory_min", std::string(str(s->memory_min()))},
                   {"device", std::string(str(s->device()))},
                   {"max_attempts", s->max_attempts()}};
    out["exit_code"] = j.exit_code();
    out["log_bytes"] = j.log_bytes();
    if (const auto* m = j.program_memory()) {
      out["program_memory"] = {{"leased_bytes", m->leased_bytes()},
                               {"peak_leased_bytes", m->peak_leased_bytes()},
                               {"in_use_bytes", m->in_use_bytes()},
                               {"peak_in_use_bytes", m->peak_in_use_bytes()},
                               {"allocations", m->allocations()},
                               {"cache_hits", m->cache_hits()},
                               {"lease_requests", m->lease_requests()},
                               {"outside_pool_bytes", m->outside_pool_bytes()}};
    }
  } else if (const auto* s = j.spec()) {
    out["spec"] = {{"batch_size", s->batch_size()},
                   {"epochs", s->epochs()},
                   {"steps", s->steps()},
                   {"layers", s->model() ? s->model()->size() : 0},
                   {"memory_budget", std::string(str(s->memory_budget()))},
                   {"memory_min", std::string(str(s->memory_min()))},
                   {"device", std::string(str(s->device()))},
                   {"max_attempts", s->max_attempts()}};
  }
  return out;
}

std::string jobs_to_table(const std::vector<const proto::JobInfo*>& jobs) {
  std::ostringstream os;
  char line[320];
  std::snprintf(line, sizeof line, "%6s  %-24s %-12s %-10s %8s %12s  %-16s %-22s %6s\n", "ID",
                "NAME", "USER", "STATE", "ATTEMPTS", "INTERRUPTED", "AGENT", "PROGRESS", "AGE");
  os << line;
  for (const auto* j : jobs) {
    std::snprintf(line, sizeof line, "%6llu  %-24s %-12s %-10s %8u %12u  %-16s %-22s %6s\n",
                  (unsigned long long)j->id(), std::string(str(j->name())).c_str(),
                  j->submitted_by() && j->submitted_by()->size() ? j->submitted_by()->c_str()
                                                                 : "-",
                  job_state_text(*j).c_str(), attempt_count(*j),
                  interruption_count(*j),
                  j->agent() && j->agent()->size() ? j->agent()->c_str() : "-",
                  short_progress(*j).c_str(), age(j->submitted_ms()).c_str());
    os << line;
  }
  return os.str();
}

std::string job_to_text(const proto::JobInfo& j) {
  std::ostringstream os;
  os << "Job " << j.id() << " '" << str(j.name()) << "': " << job_state_text(j);
  if (j.agent() && j.agent()->size()) os << " on agent '" << str(j.agent()) << "'";
  if (const auto* last = j.attempts() && j.attempts()->size()
                             ? j.attempts()->Get(j.attempts()->size() - 1)
                             : nullptr;
      last && last->replica_agents() && last->replica_agents()->size()) {
    os << " and " << last->replica_agents()->size() << " more replica"
       << (last->replica_agents()->size() > 1 ? "s" : "");
  }
  os << "\n";
  if (j.reason() && j.reason()->size()) os << "  reason: " << str(j.reason()) << "\n";
  os << "  submitted by " << (j.submitted_by() && j.submitted_by()->size() ? str(j.submitted_by())
                                                                            : "an unknown user")
     << " at " << when(j.submitted_ms());
  if (j.cancelled_by() && j.cancelled_by()->size()) {
    os << "; cancelled by " << str(j.cancelled_by());
  }
  os << "\n";
  if (const auto* s = j.spec(); s && s->program()) {
    os << "  program:";
    if (s->program()->command()) {
      for (const auto* a : *s->program()->command()) os << " " << str(a);
    }
    os << " (in " << str(s->program()->directory()) << "), budget "
       << (s->memory_budget() ? s->memory_budget()->str() : "1GiB");
    if (s->memory_min()) os << " (guaranteed " << s->memory_min()->str() << ")";
    os << "\n";
    if (j.exit_code() >= 0) os << "  exit status: " << j.exit_code() << "\n";
    os << "  output: " << format_bytes(j.log_bytes()) << " (leasehold logs " << j.id() << ")\n";
    if (const auto* m = j.program_memory()) {
      os << "  memory (its plug-in): leased " << format_bytes(m->leased_bytes()) << " (peak "
         << format_bytes(m->peak_leased_bytes()) << "), in use " << format_bytes(m->in_use_bytes())
         << " (peak " << format_bytes(m->peak_in_use_bytes()) << "), " << m->allocations()
         << " allocations, " << m->cache_hits() << " from its cache, " << m->lease_requests()
         << " lease requests\n";
      if (m->outside_pool_bytes() > 0) {
        os << "  device memory outside the pool (its CUDA context, own allocations): "
           << format_bytes(m->outside_pool_bytes()) << "\n";
      }
    }
  } else if (const auto* s = j.spec()) {
    os << "  spec: " << (s->model() ? s->model()->size() : 0) << " layers, batch "
       << s->batch_size() << ", "
       << (s->epochs() ? std::to_string(s->epochs()) + " epochs"
                       : std::to_string(s->steps()) + " steps")
       << ", optimizer "
       << (s->optimizer() ? proto::EnumNameOptimizerType(s->optimizer()->type()) : "Adam")
       << ", budget " << (s->memory_budget() ? s->memory_budget()->str() : "1GiB");
    if (s->memory_min()) os << " (guaranteed " << s->memory_min()->str() << ")";
    os << "\n";
  }
  if (j.waiting_for() && j.waiting_for()->size()) {
    os << "  waiting: " << str(j.waiting_for()) << "\n";
  }
  if (j.assigned_at_us()) {
    // The latest attempt's start, from the submission (ms precision).
    auto after = [&](uint64_t us) {
      double ms = static_cast<double>(us) / 1000.0 - static_cast<double>(j.submitted_ms());
      char buf[64];
      std::snprintf(buf, sizeof buf, "%.1f ms", ms);
      return std::string(buf);
    };
    os << "  started: assigned at " << when(j.assigned_at_us() / 1000);
    if (attempt_count(j) == 1) os << " (" << after(j.assigned_at_us()) << " after submission)";
    if (j.first_step_at_us()) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "%.1f ms",
                    (static_cast<double>(j.first_step_at_us()) - static_cast<double>(j.assigned_at_us())) / 1000.0);
      os << ", first step " << buf << " later";
    }
    os << "\n";
  }
  const bool program = j.spec() && j.spec()->program();
  os << (program ? "  checkpoint folder (LEASEHOLD_CHECKPOINT_DIR): " : "  checkpoint: ")
     << (j.checkpoint() && j.checkpoint()->size()
             ? (program ? std::filesystem::path(std::string(str(j.checkpoint())))
                              .parent_path()
                              .string()
                        : std::string(str(j.checkpoint())))
             : "off");
  if (j.resumed_from_epoch()) os << " (the latest attempt resumed from epoch " << j.resumed_from_epoch() << ")";
  os << "\n";
  os << "  history:\n";
  if (j.history()) {
    for (const auto* h : *j.history()) {
      os << "    " << when(h->at_ms()) << "  " << job_state_text(*h);
      if (h->reason() && h->reason()->size()) os << " (" << str(h->reason()) << ")";
      os << "\n";
    }
  }
  if (j.attempts() && j.attempts()->size()) {
    // What became of each attempt, and what counts against max_attempts.
    const unsigned interrupted = interruption_count(j);
    os << "  attempts: " << attempt_count(j) << "; ";
    if (interrupted) {
      os << "interrupted " << interrupted << (interrupted == 1 ? " time" : " times") << " ("
         << interruption_words(j) << ")";
    } else {
      os << "never interrupted";
    }
    os << "; " << j.agent_failures() << " of " << j.max_attempts()
       << " allowed failures used (a dead agent or the job's own device fault counts):\n";
    for (const auto* a : *j.attempts()) {
      os << "    " << a->number() << "  on '" << str(a->agent()) << "'";
      if (a->replica_agents()) {  // a data-parallel job: its other replicas' agents
        for (const auto* r : *a->replica_agents()) os << ", '" << r->str() << "'";
      }
      os << " from " << when(a->started_ms());
      if (a->ended_ms()) os << " to " << when(a->ended_ms());
      if (a->resumed_from_epoch()) os << ", resumed from epoch " << a->resumed_from_epoch();
      os << ": " << (a->outcome() && a->outcome()->size() ? str(a->outcome()) : "running");
      if (a->cause() && a->cause()->size()) {
        auto cause = interruption_from_name(std::string(str(a->cause())));
        os << ", " << (cause ? std::string(leasehold::interruption_words(*cause)) : str(a->cause()));
      }
      if (a->reason() && a->reason()->size()) os << " (" << str(a->reason()) << ")";
      os << "\n";
    }
  }
  if (j.epochs() && j.epochs()->size()) {
    os << "  epochs";
    if (j.epochs_total() > j.epochs()->size()) {
      os << " (the latest " << j.epochs()->size() << " of " << j.epochs_total() << ")";
    }
    os << ":\n";
    for (const auto* e : *j.epochs()) {
      char buf[32];
      std::snprintf(buf, sizeof buf, "    %3d  ", e->epoch());
      os << buf << epoch_figures(*e);
      std::snprintf(buf, sizeof buf, ", %.1f s\n", e->seconds());
      os << buf;
    }
  }
  if (const auto* p = j.progress(); p && p->peak_device_bytes()) {
    os << "  memory: peak " << format_bytes(p->peak_device_bytes()) << " on the device";
    if (p->spilled_bytes()) {
      os << "; spilled " << format_bytes(p->spilled_bytes()) << ", restored "
         << format_bytes(p->restored_bytes()) << "; held now: host "
         << format_bytes(p->spill_host_bytes()) << ", file " << format_bytes(p->spill_file_bytes());
    } else {
      os << "; nothing spilled";
    }
    os << "\n";
  }
  if (j.memory_wait_ms() || j.shrinks()) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "  occupancy: waited %.1f s for memory; %u shrink(s) released %s\n",
                  j.memory_wait_ms() / 1000.0, j.shrinks(), format_bytes(j.shrunk_bytes()).c_str());
    os << buf;
  }
  if (job_state_text(j) == "succeeded") {
    os << "  result: " << result_summary(j) << "\n";
  } else if (j.progress() && j.progress()->total_steps()) {
    os << "  progress: " << progress_line(j, false) << "\n";
  }
  return os.str();
}

std::string progress_line(const proto::JobInfo& j, bool bar) {
  const auto* p = j.progress();
  if (!p || p->total_steps() == 0) return job_state_text(j);
  char buf[256];
  std::string b;
  if (bar) {
    int width = 24;
    int filled = p->steps_in_epoch() ? int(width * p->step() / p->steps_in_epoch()) : 0;
    b = "[" + std::string(filled, '#') + std::string(width - filled, '.') + "] ";
  }
  std::snprintf(buf, sizeof buf, "epoch %d/%d %s%lld/%lld loss %.4f %.0f samples/s ETA %.0fs",
                p->epoch(), p->epochs(), b.c_str(), (long long)p->step(),
                (long long)p->steps_in_epoch(), p->loss(), p->samples_per_second(),
                p->eta_seconds());
  return buf;
}

std::string epoch_figures(const proto::EpochStat& e) {
  char buf[160];
  if (e.validation_loss() > 0) {
    std::snprintf(buf, sizeof buf,
                  "train loss %.4f, validation loss %.4f (%.3f bits/byte), next-token accuracy "
                  "%.2f%%",
                  e.train_loss(), e.validation_loss(), e.validation_loss() / std::log(2.0),
                  100 * e.test_accuracy());
  } else {
    std::snprintf(buf, sizeof buf, "train loss %.4f, test accuracy %.2f%%", e.train_loss(),
                  100 * e.test_accuracy());
  }
  return buf;
}

}  // namespace leasehold
