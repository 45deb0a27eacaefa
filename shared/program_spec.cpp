#include "shared/program_spec.h"

#include <sys/stat.h>

#include <cctype>
#include <cerrno>
#include <cstring>
#include <set>

#include "shared/printable.h"

namespace leasehold {
namespace {

std::string quoted(std::string_view text) { return "'" + printable(std::string(text), 256) + "'"; }

bool valid_env_name(std::string_view name) {
  if (name.empty() || name.size() > 256 || std::isdigit(static_cast<unsigned char>(name[0]))) {
    return false;
  }
  for (char c : name) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) && static_cast<unsigned char>(c) < 0x80) &&
        c != '_') {
      return false;
    }
  }
  return true;
}

// Whether the submitter (uid, gid; -1: not known) may read and enter a
// folder of this owner and mode.
bool submitter_may_enter(const struct stat& st, int64_t uid, int64_t gid) {
  if (uid == 0) return true;
  if (static_cast<int64_t>(st.st_uid) == uid) return (st.st_mode & 0500) == 0500;
  if (gid >= 0 && static_cast<int64_t>(st.st_gid) == gid) return (st.st_mode & 0050) == 0050;
  return (st.st_mode & 0005) == 0005;
}

}  // namespace

bool reserved_environment_name(std::string_view name) {
  return name.rfind("LEASEHOLD_", 0) == 0 || name == "CUDA_MPS_PIPE_DIRECTORY" ||
         name == "CUDA_MPS_LOG_DIRECTORY" || name == "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE";
}

void validate_program(const proto::JobSpec& job, const ValidationOptions& options,
                      std::vector<std::string>& p) {
  const proto::ProgramSpec& prog = *job.program();
  // What only an engine job has.
  const std::pair<const char*, bool> engine_fields[] = {
      {"model", job.model() != nullptr},
      {"dataset", job.dataset() != nullptr},
      {"optimizer", job.optimizer() != nullptr},
      {"epochs", job.epochs() != 0},
      {"steps", job.steps() != 0},
      {"spill", job.spill() != nullptr},
      {"publish_parameters", job.publish_parameters() != nullptr},
      {"init_from", job.init_from() != nullptr}};
  for (const auto& [field, present] : engine_fields) {
    if (present) {
      p.push_back(std::string(field) +
                  ": not for a program job (its program decides what it trains)");
    }
  }
  const auto* command = prog.command();
  if (!command || command->size() == 0) {
    p.push_back("program.command: required: the program and its arguments, a list of strings");
  } else if (command->size() > kMaxProgramArguments) {
    p.push_back("program.command: " + std::to_string(command->size()) +
                " arguments, more than " + std::to_string(kMaxProgramArguments));
  } else {
    // (Control characters and bytes that are not UTF-8 were refused with
    // every text field.)
    if (command->Get(0)->size() == 0) {
      p.push_back("program.command[0]: empty (the program to run)");
    }
  }
  const std::string dir = prog.directory() ? prog.directory()->str() : "";
  if (dir.empty()) {
    p.push_back("program.directory: required (its working folder; `leasehold run` gives the "
                "current one)");
  } else if (dir.front() != '/') {
    p.push_back("program.directory: " + quoted(dir) + " is not an absolute path");
  } else if (options.check_files) {
    struct stat st {};
    if (options.submitter_uid < 0) {
      p.push_back("program.directory: the submitter's user is not known (a network client): a "
                  "program job is submitted over the local socket");
    } else if (::stat(dir.c_str(), &st) != 0) {
      p.push_back("program.directory: " + quoted(dir) + ": " + std::strerror(errno));
    } else if (!S_ISDIR(st.st_mode)) {
      p.push_back("program.directory: " + quoted(dir) + " is not a folder");
    } else if (!submitter_may_enter(st, options.submitter_uid, options.submitter_gid)) {
      p.push_back("program.directory: " + quoted(dir) + " is not readable by its submitter (uid " +
                  std::to_string(options.submitter_uid) + ")");
    }
  }
  if (const auto* env = prog.environment()) {
    if (env->size() > kMaxProgramEnvironment) {
      p.push_back("program.environment: " + std::to_string(env->size()) +
                  " entries, more than " + std::to_string(kMaxProgramEnvironment));
    }
    std::set<std::string> seen;
    for (flatbuffers::uoffset_t i = 0; i < env->size() && i < kMaxProgramEnvironment; ++i) {
      const auto* v = env->Get(i);
      const std::string at = "program.environment[" + std::to_string(i) + "]";
      const std::string name = v && v->name() ? v->name()->str() : "";
      if (!valid_env_name(name)) {
        p.push_back(at + ".name: " + quoted(name) +
                    " is not a variable name (letters, digits and '_', not starting with a digit)");
      } else if (reserved_environment_name(name)) {
        p.push_back(at + ".name: " + name +
                    " is the agent's to set for a program job (LEASEHOLD_*, CUDA_MPS_*)");
      } else if (!seen.insert(name).second) {
        p.push_back(at + ".name: " + name + " is given twice");
      }
    }
  }
}

}  // namespace leasehold
