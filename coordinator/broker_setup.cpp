#include "coordinator/broker_setup.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "coordinator/occupancy_policy.h"
#include "shared/connection.h"
#include "shared/endpoint.h"
#include "shared/process.h"

namespace leasehold {

void ensure_no_live_coordinator(zmq::context_t& ctx, const std::string& endpoint) {
  auto path = ipc_path(endpoint);
  if (!path || !std::filesystem::exists(*path)) return;
  Connection probe(ctx, endpoint, "leasehold-coordinator-probe");
  try {
    probe.request(
        [](flatbuffers::FlatBufferBuilder& fbb) {
          return std::pair{proto::Body::StatusRequest, proto::CreateStatusRequest(fbb).Union()};
        },
        std::chrono::milliseconds(300));
  } catch (const Error&) {
    spdlog::info("replacing stale socket {} left by an earlier run", *path);
    return;
  }
  throw std::runtime_error("another leasehold-coordinator is already serving at " + endpoint);
}

namespace {

// Makes `dir` (and missing parents) a folder of this user's with exactly
// `mode` and `group` (-1: as created), whatever the umask; an existing one
// of ours with a wider mode is narrowed. Throws naming the folder.
void private_folder(const std::string& dir, mode_t mode, gid_t group) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    throw std::runtime_error("cannot create the folder " + dir + ": " +
                             (ec ? ec.message() : "not a directory"));
  }
  if (st.st_uid != ::geteuid()) {
    // Made by someone else (an installer as root): its mode is theirs to set.
    if (st.st_mode & 07777 & ~mode) {
      spdlog::warn(
          "{} belongs to uid {} and has mode {:04o}: other users may read what is in "
          "it; make it {:04o} and this coordinator's user's",
          dir, st.st_uid, st.st_mode & 07777, mode);
    }
    return;
  }
  if (group != static_cast<gid_t>(-1) && st.st_gid != group &&
      ::chown(dir.c_str(), -1, group) != 0) {
    throw std::runtime_error("cannot give " + dir + " to group " + std::to_string(group) + ": " +
                             std::strerror(errno));
  }
  if ((st.st_mode & 07777) != mode) {
    if (::chmod(dir.c_str(), mode) != 0) {
      throw std::runtime_error("cannot set the mode of " + dir + ": " + std::strerror(errno));
    }
    if ((st.st_mode & 07777 & ~mode) != 0) {
      spdlog::info(
          "narrowed {} from mode {:04o} to {:04o}: jobs, checkpoints and keys are "
          "nobody else's to read",
          dir, st.st_mode & 07777, mode);
    }
  }
}

}  // namespace

int lock_state_dir(const std::string& dir, gid_t group) {
  // Other users read nothing in it (jobs, their files and checkpoints); the
  // socket group, when there is one, may reach their own jobs' folders.
  const bool grouped = group != static_cast<gid_t>(-1);
  private_folder(dir, grouped ? 0750 : 0700, group);
  private_folder(dir + "/checkpoints", grouped ? 0750 : 0700, group);
  std::string path = dir + "/coordinator.lock";
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) throw std::runtime_error("cannot open " + path + ": " + std::strerror(errno));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    int err = errno;
    ::close(fd);
    throw std::runtime_error(err == EWOULDBLOCK
                                 ? "another leasehold-coordinator uses the state directory " + dir
                                 : "cannot lock " + path + ": " + std::strerror(err));
  }
  return fd;
}

uint64_t largest_checkpoint_id(const std::string& state_dir) {
  uint64_t largest = 0;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(state_dir + "/checkpoints", ec)) {
    const std::string name = entry.path().filename().string();
    if (name.empty() || name.size() > 19 ||
        name.find_first_not_of("0123456789") != std::string::npos) {
      continue;
    }
    largest = std::max<uint64_t>(largest, std::stoull(name));
  }
  return largest;
}

std::unique_ptr<MpsDaemon> start_mps(const CoordinatorOptions& o) {
  if (o.mps == "off" || o.backend == "host") return nullptr;
  if (!o.mps_directory.empty()) return MpsDaemon::attach(o.mps_directory);
  const bool required = o.mps == "on";
  // Under systemd a daemon this process started would die with its unit
  // (and its runtime folder) at every restart, taking the agents' CUDA
  // contexts along: there, MPS is a unit of its own (leasehold-mps.service)
  // named by mps_directory.
  if (std::getenv("INVOCATION_ID")) {
    const std::string why =
        "under systemd the MPS daemon runs as a unit of its own: start "
        "leasehold-mps.service and set mps_directory to its pipe folder";
    if (required) throw std::runtime_error("mps = on: " + why);
    spdlog::warn("no MPS (mps = auto): {}", why);
    return nullptr;
  }
  auto control = find_mps_control();
  if (!control) {
    if (required) {
      throw std::runtime_error(
          "mps = on, but nvidia-cuda-mps-control is not on the PATH (add the driver's folder "
          "to PATH, set mps_directory to a running daemon's pipe folder, or set mps = off)");
    }
    spdlog::info("no MPS: nvidia-cuda-mps-control is not on the PATH (mps = auto)");
    return nullptr;
  }
  // Its folders beside the ipc socket (the runtime directory), else in the
  // state directory.
  std::string dir = o.state_dir + "/mps";
  if (auto path = ipc_path(o.endpoint)) dir = std::filesystem::path(*path).parent_path().string();
  try {
    return MpsDaemon::start(*control, dir);
  } catch (const std::exception& e) {
    if (required) throw;
    spdlog::warn("no MPS (mps = auto): {}", e.what());
    return nullptr;
  }
}

uint16_t free_tcp_port() {
  // As torchrun does: the kernel picks a port free now; rank 0 binds it
  // moments later (another process could take it in between, which the
  // replicas then report as a failed rendezvous).
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof addr;
  uint16_t port = 0;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    port = ntohs(addr.sin_port);
  }
  ::close(fd);
  return port;
}

CoreOptions core_options(const CoordinatorOptions& o) {
  CoreOptions c;
  c.free_port = free_tcp_port;
  c.follow_process = [](const Peer& p) { return follow_process(p.pid, p.uid); };
  c.end_silent_agents = o.end_silent_agents;
  c.heartbeat_interval = o.heartbeat_interval;
  c.silence_limit = o.silence_limit;
  c.lease_wait_timeout = o.lease_wait_timeout;
  c.recovery_grace = o.recovery_grace;
  c.state_dir = o.state_dir;
  c.retention_count = o.job_retention_count;
  c.queued_per_user = o.queued_per_user;
  c.epochs_kept = o.job_epochs_kept;
  c.history_kept = o.job_history_kept;
  c.waiting_per_agent = o.waiting_per_agent;
  c.max_lease_wait = o.max_lease_wait;
  c.job_limits = {o.max_epochs, o.max_steps};
  c.retention_age = o.job_retention_age;
  c.shrink_timeout = o.shrink_timeout;
  c.access = AccessPolicy(o.agent_group, o.client_group, o.admin_group, o.program_group);
  c.assign_timeout = o.assign_timeout;
  c.stop_timeout = o.stop_timeout;
  c.fault_probation = o.fault_probation;
  return c;
}

std::unique_ptr<SchedulingPolicy> make_policy(const CoordinatorOptions& o) {
  if (o.policy == "fifo") return std::make_unique<FifoPolicy>();
  return std::make_unique<OccupancyPolicy>(OccupancyOptions{o.low_watermark, o.high_watermark});
}

}  // namespace leasehold
