#include "coordinator/agent_process.h"

#include <poll.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <string>

#include "shared/process.h"

namespace leasehold {
namespace {

// Through syscall(2): glibc 2.36's <sys/pidfd.h> (Debian 12) declares its
// wrappers without C linkage, so C++ cannot link them.
int open_pidfd(pid_t pid) { return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)); }
int send_signal(int pidfd, int sig) {
  return static_cast<int>(::syscall(SYS_pidfd_send_signal, pidfd, sig, nullptr, 0));
}

std::string read_proc_stat(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  std::getline(in, line);
  return line;
}

class PidfdProcess final : public AgentProcess {
 public:
  PidfdProcess(pid_t pid, uid_t uid) : pid_(pid), uid_(uid) {
    fd_ = open_pidfd(pid);
    // ESRCH: gone already. ENOSYS (a kernel before 5.3): fall back to the
    // pid, which is only as good as the pid's not being reused.
    if (fd_ < 0) gone_at_open_ = errno == ESRCH;
  }
  ~PidfdProcess() override {
    if (fd_ >= 0) ::close(fd_);
  }
  PidfdProcess(const PidfdProcess&) = delete;
  PidfdProcess& operator=(const PidfdProcess&) = delete;

  int pid() const override { return pid_; }

  bool gone() const override {
    if (gone_at_open_) return true;
    if (fd_ < 0) return process_gone(pid_);
    // A pidfd becomes readable when its process exits.
    pollfd p{fd_, POLLIN, 0};
    int n;
    do {
      n = ::poll(&p, 1, 0);
    } while (n < 0 && errno == EINTR);
    return n > 0;
  }

  bool stopped() const override {
    if (gone()) return false;
    // /proc/PID/stat: "pid (comm) S ...", comm may hold spaces and ')'.
    const std::string stat = read_proc_stat(pid_);
    const auto close = stat.rfind(')');
    if (close == std::string::npos || close + 2 >= stat.size()) return false;
    const char state = stat[close + 2];
    // Read before asking gone() again: a pid reused in between is not ours.
    return (state == 'T' || state == 't') && !gone();
  }

  std::string end() override {
    if (gone()) return "";
    if (uid_ != ::geteuid()) {
      return "its process (pid " + std::to_string(pid_) + ") runs as uid " + std::to_string(uid_) +
             ", not the coordinator's uid " + std::to_string(::geteuid());
    }
    int rc = fd_ >= 0 ? send_signal(fd_, SIGKILL) : ::kill(pid_, SIGKILL);
    if (rc == 0 || errno == ESRCH) return "";
    return "SIGKILL to pid " + std::to_string(pid_) + " failed: " + std::strerror(errno);
  }

 private:
  const pid_t pid_;
  const uid_t uid_;
  int fd_ = -1;
  bool gone_at_open_ = false;
};

}  // namespace

std::shared_ptr<AgentProcess> follow_process(pid_t pid, uid_t uid) {
  if (pid <= 0) return nullptr;
  return std::make_shared<PidfdProcess>(pid, uid);
}

}  // namespace leasehold
