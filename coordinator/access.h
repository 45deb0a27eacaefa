// Who may do what, from the configuration's groups and the peer's kernel
// credentials (coordinator/peer.h):
//   agent_group  may register as an agent;
//   client_group may submit jobs and drop regions;
//   admin_group  may cancel anyone's job (a submitter may cancel their own);
//   program_group may submit program jobs (which run their own code as the
//                agent's user): unset, only root and the coordinator's user
//                may; "*": anyone client_group lets submit.
// An unset client_group lets everyone who can reach the socket submit.
// Agents run other users' jobs and report their results, so an unset
// agent_group lets only root and the coordinator's own user register one;
// agent_group = "*" opens registration to everyone who can reach the
// socket, explicitly. Cancelling others' jobs needs admin_group. root and
// the coordinator's own user pass every check. Over tcp:// the allowed-keys
// folders are the groups (coordinator/zap_handler.h): a key in
// curve_allowed_keys may submit, one in curve_allowed_keys/agents may
// register, whatever the groups say; no key acts on others' jobs. A peer
// of unknown credentials passes only unset groups.
//
// Membership is the user's primary group or a supplementary one from the
// group database (getgrouplist). The broker's peers carry both, looked up
// off the loop when they connected; for a peer without them (tests of the
// core) they are looked up here and cached for a minute per uid.
//
// Thread safety: used by the loop only.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "coordinator/peer.h"

namespace leasehold {

enum class Role { Agent, Client, Admin, Program };

// A user's name ("uid N" without a passwd entry) and groups (primary and
// supplementary), from the passwd and group databases: may block (NSS on
// LDAP), so the broker's ZAP handler calls it off the loop, once per
// connection (coordinator/zap_handler.h).
struct UserInfo {
  std::string name;
  std::vector<uint32_t> groups;
};
UserInfo look_up_user(uint32_t uid);

class AccessPolicy {
 public:
  AccessPolicy();  // every group unset: agents of root and this user only
  // An AccessPolicy whose agent_group is "*" (anyone may register).
  static constexpr const char* kAnyone = "*";
  // Resolves the group names; throws std::invalid_argument naming the
  // option and the group when one does not exist.
  AccessPolicy(const std::string& agent_group, const std::string& client_group,
               const std::string& admin_group, const std::string& program_group = "");

  // nullopt when `peer` may act as `role`; else why not (naming the user,
  // the option and the group).
  std::optional<std::string> check(Role role, const Peer& peer) const;
  // "alice", or "uid 1234" without a passwd entry: what the ZAP handler
  // looked up for `peer`, else looked up now.
  std::string user_name(const Peer& peer) const;

 private:
  struct Group {
    std::string option, name;
    gid_t gid = 0;
  };
  bool member(const Peer& peer, const Group& group) const;

  std::optional<Group> agent_, client_, admin_, program_;
  bool anyone_registers_ = false;      // agent_group = "*"
  bool anyone_runs_programs_ = false;  // program_group = "*"
  uid_t self_ = 0;
  struct Cached {
    std::vector<uint32_t> groups;
    std::chrono::steady_clock::time_point at;
  };
  mutable std::map<uint32_t, Cached> cache_;
};

}  // namespace leasehold
