#include "coordinator/access.h"

#include <grp.h>
#include <pwd.h>
#include <unistd.h>

#include <algorithm>
#include <stdexcept>

namespace leasehold {
namespace {

constexpr auto kCacheFor = std::chrono::minutes(1);

std::optional<gid_t> group_id(const std::string& option, const std::string& name) {
  if (name.empty()) return std::nullopt;
  std::vector<char> buf(16384);
  group g{}, *found = nullptr;
  if (getgrnam_r(name.c_str(), &g, buf.data(), buf.size(), &found) != 0 || !found) {
    throw std::invalid_argument(option + ": no group named '" + name + "' on this machine");
  }
  return found->gr_gid;
}

}  // namespace

AccessPolicy::AccessPolicy() : self_(::getuid()) {}

AccessPolicy::AccessPolicy(const std::string& agent_group, const std::string& client_group,
                           const std::string& admin_group, const std::string& program_group)
    : self_(::getuid()) {
  auto make = [](const char* option, const std::string& name) -> std::optional<Group> {
    auto gid = group_id(option, name);
    if (!gid) return std::nullopt;
    return Group{option, name, *gid};
  };
  anyone_registers_ = agent_group == kAnyone;
  agent_ = make("agent_group", anyone_registers_ ? std::string() : agent_group);
  client_ = make("client_group", client_group);
  admin_ = make("admin_group", admin_group);
  anyone_runs_programs_ = program_group == kAnyone;
  program_ = make("program_group", anyone_runs_programs_ ? std::string() : program_group);
}

UserInfo look_up_user(uint32_t uid) {
  UserInfo info{"uid " + std::to_string(uid), {}};
  std::vector<char> buf(16384);
  passwd pw{}, *found = nullptr;
  if (getpwuid_r(uid, &pw, buf.data(), buf.size(), &found) != 0 || !found) return info;
  info.name = found->pw_name;
  int n = 64;
  std::vector<gid_t> groups(static_cast<size_t>(n));
  if (getgrouplist(found->pw_name, found->pw_gid, groups.data(), &n) < 0) {
    groups.resize(size_t(n));
    getgrouplist(found->pw_name, found->pw_gid, groups.data(), &n);
  }
  groups.resize(size_t(std::max(n, 0)));
  info.groups.assign(groups.begin(), groups.end());
  return info;
}

std::string AccessPolicy::user_name(const Peer& peer) const {
  if (!peer.user.empty()) return peer.user;
  return look_up_user(peer.uid).name;
}

bool AccessPolicy::member(const Peer& peer, const Group& group) const {
  if (peer.gid == group.gid) return true;
  const std::vector<uint32_t>* groups = peer.groups ? &*peer.groups : nullptr;
  if (!groups) {
    const auto now = std::chrono::steady_clock::now();
    auto it = cache_.find(peer.uid);
    if (it == cache_.end() || now - it->second.at > kCacheFor) {
      if (cache_.size() > 4096) cache_.clear();  // bounded: uids are few
      it = cache_.insert_or_assign(peer.uid, Cached{look_up_user(peer.uid).groups, now}).first;
    }
    groups = &it->second.groups;
  }
  return std::find(groups->begin(), groups->end(), group.gid) != groups->end();
}

std::optional<std::string> AccessPolicy::check(Role role, const Peer& peer) const {
  const std::optional<Group>& group = role == Role::Agent     ? agent_
                                      : role == Role::Client  ? client_
                                      : role == Role::Program ? program_
                                                              : admin_;
  if (peer.known && (peer.uid == 0 || peer.uid == self_)) return std::nullopt;
  // Over the network the allowed-keys folders admit agents and clients
  // (coordinator/zap_handler.h); no key may act on others' jobs.
  if (role == Role::Program && !peer.key.empty()) {
    return "key " + peer.key +
           " may not submit a program job: its folder and its user are checked on this host, "
           "so program jobs are submitted over the local socket";
  }
  if (role != Role::Admin && !peer.key.empty()) {
    if (role == Role::Agent ? peer.key_agent : peer.key_client) return std::nullopt;
    return "key " + peer.key + " may not " +
           (role == Role::Agent ? std::string("register as an agent: its .pub file is not in "
                                              "curve_allowed_keys/agents")
                                : std::string("submit jobs or drop regions: its .pub file is not "
                                              "directly in curve_allowed_keys"));
  }
  if (role == Role::Agent && anyone_registers_) return std::nullopt;
  if (role == Role::Program && anyone_runs_programs_) return std::nullopt;
  if (role == Role::Client && !group) return std::nullopt;
  const char* what = role == Role::Agent     ? "register as an agent"
                     : role == Role::Client  ? "submit jobs or drop regions"
                     : role == Role::Program ? "submit program jobs"
                                             : "act on other users' jobs";
  const std::string who =
      peer.known ? user_name(peer) + " (uid " + std::to_string(peer.uid) + ")" : peer.key_user();
  if (!group && role == Role::Agent) {
    return (who.empty() ? std::string("an unknown user") : who) + " may not " + what +
           ": only root and the coordinator's user may (agent_group is not set; set it to a "
           "group, or to \"*\" to let anyone who can reach the socket register)";
  }
  if (!group && role == Role::Program) {
    return (who.empty() ? std::string("an unknown user") : who) + " may not " + what +
           ": a program runs its own code as the agents' user, so only root and the "
           "coordinator's user may (program_group is not set; set it to a group, or to \"*\" "
           "to let everyone who may submit jobs run programs)";
  }
  if (!group) {
    return (who.empty() ? std::string() : who + " may not " + what + ": ") +
           "only root, the coordinator's user or members of admin_group may (admin_group is not "
           "set)";
  }
  if (!peer.known) {
    return std::string("the connection's user is unknown (not an ipc:// socket); ") + what +
           " needs " + group->option + " '" + group->name + "'";
  }
  if (member(peer, *group)) return std::nullopt;
  return who + " is not in " + group->option + " '" + group->name + "', which may " + what;
}

}  // namespace leasehold
