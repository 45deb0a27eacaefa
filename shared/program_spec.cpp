#include "shared/program_spec.h"

#include <grp.h>
#include <pwd.h>
#include <sys/stat.h>

#include <cctype>
#include <cerrno>
#include <cstring>
#include <algorithm>
#include <set>
#include <vector>

#include "shared/printable.h"

namespace leasehold {
namespace {

// Values quoted in errors are cut to this many bytes.
constexpr size_t kQuotedBytes = 256;

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

// The groups of user `uid`: its primary group `gid` and those it is a
// member of (the kernel's peer credentials carry only the primary one).
std::vector<gid_t> groups_of(int64_t uid, int64_t gid) {
  std::vector<gid_t> groups;
  if (gid >= 0) groups.push_back(static_cast<gid_t>(gid));
  std::vector<char> buf(16384);
  struct passwd pw {};
  struct passwd* found = nullptr;
  if (::getpwuid_r(static_cast<uid_t>(uid), &pw, buf.data(), buf.size(), &found) == 0 && found) {
    int n = 64;
    std::vector<gid_t> more(n);
    if (::getgrouplist(pw.pw_name, pw.pw_gid, more.data(), &n) < 0) {
      more.resize(n);
      if (::getgrouplist(pw.pw_name, pw.pw_gid, more.data(), &n) < 0) n = 0;
    }
    more.resize(n);
    groups.insert(groups.end(), more.begin(), more.end());
  }
  return groups;
}

// Whether the submitter (uid; its groups) has the permission bits `want`
// (4 read, 1 search) on a file of this owner and mode.
bool submitter_may(const struct stat& st, int64_t uid, const std::vector<gid_t>& groups,
                   unsigned want) {
  if (uid == 0) return true;
  if (static_cast<int64_t>(st.st_uid) == uid) return ((st.st_mode >> 6) & want) == want;
  for (gid_t g : groups) {
    if (st.st_gid == g) return ((st.st_mode >> 3) & want) == want;
  }
  return (st.st_mode & want) == want;
}

// Empty when the submitter may search every folder above `dir` and read and
// search `dir` itself; else the folder that stops it (or why it cannot be
// looked at).
std::string submitter_refused_at(const std::string& dir, int64_t uid, int64_t gid) {
  const std::vector<gid_t> groups = groups_of(uid, gid);
  std::vector<std::string> folders{"/"};
  for (size_t pos = 0; pos < dir.size();) {
    const size_t end = std::min(dir.find('/', pos), dir.size());
    if (end > pos) folders.push_back((folders.size() == 1 ? "" : folders.back()) + "/" +
                                     dir.substr(pos, end - pos));
    pos = end + 1;
  }
  for (size_t i = 0; i < folders.size(); ++i) {
    struct stat st {};
    if (::stat(folders[i].c_str(), &st) != 0) return folders[i] + ": " + std::strerror(errno);
    const bool last = i + 1 == folders.size();
    if (!submitter_may(st, uid, groups, last ? 5u : 1u)) return last ? dir : folders[i];
  }
  return "";
}

}  // namespace

bool reserved_environment_name(std::string_view name) {
  // Which GPU `LEASEHOLD_DEVICE` names, and the MPS daemon the agent joined,
  // are the agent's: a program that renumbered or hid devices would map the
  // pool on another GPU, or compute on one nobody scheduled.
  static const std::set<std::string_view> reserved = {
      "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
      "CUDA_VISIBLE_DEVICES",    "CUDA_DEVICE_ORDER",      "NVIDIA_VISIBLE_DEVICES"};
  return name.rfind("LEASEHOLD_", 0) == 0 || reserved.count(name) > 0;
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
    p.push_back("program.directory: " + in_quotes(dir, kQuotedBytes) + " is not an absolute path");
  } else if (options.check_files) {
    struct stat st {};
    if (options.submitter_uid < 0) {
      p.push_back("program.directory: the submitter's user is not known (a network client): a "
                  "program job is submitted over the local socket");
    } else if (::stat(dir.c_str(), &st) != 0) {
      p.push_back("program.directory: " + in_quotes(dir, kQuotedBytes) + ": " +
                  std::strerror(errno));
    } else if (!S_ISDIR(st.st_mode)) {
      p.push_back("program.directory: " + in_quotes(dir, kQuotedBytes) + " is not a folder");
    } else if (std::string at = submitter_refused_at(dir, options.submitter_uid,
                                                     options.submitter_gid);
               !at.empty()) {
      p.push_back("program.directory: " + in_quotes(dir, kQuotedBytes) +
                  " is not readable by its submitter (uid " +
                  std::to_string(options.submitter_uid) + "): " +
                  (at == dir ? std::string("it may not read the folder")
                             : in_quotes(at, kQuotedBytes) + " may not be searched"));
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
        p.push_back(at + ".name: " + in_quotes(name, kQuotedBytes) +
                    " is not a variable name (letters, digits and '_', not starting with a digit)");
      } else if (reserved_environment_name(name)) {
        p.push_back(at + ".name: " + name +
                    " is the agent's to set for a program job (LEASEHOLD_*, CUDA_MPS_*, the visible "
                    "devices)");
      } else if (!seen.insert(name).second) {
        p.push_back(at + ".name: " + name + " is given twice");
      }
    }
  }
}

}  // namespace leasehold
